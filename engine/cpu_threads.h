// The CPU engine's threads when -t is not given. A decode step is some fifty OpenMP regions
// (one per linear), each split evenly over the team, so every region waits for its slowest
// thread; and between regions libgomp's threads spin (GOMP_SPINCOUNT, 300,000 turns by
// default) for the next one. On a machine whose cores other programs keep busy, a team of one
// thread per core has threads descheduled in every region while their partners spin on the
// cores the others need: a 2-core machine with two busy programs gave 285 ms per token at the
// default against 111 at -t 1 (docs/performance.md, 2026-12-07). So the default is the physical
// cores of the affinity mask (SMT siblings share a core's arithmetic, as llama.cpp counts them)
// scaled by the share of the mask's CPUs that were idle over a short sample, and at most the
// cgroup's CPU quota; at least 1. -t N and OMP_NUM_THREADS are taken as given. The default is
// chosen once, when the model loads: a load that starts later is not followed.
#pragma once

namespace kestrel {

struct CpuLoad {
  int logical = 1;   // CPUs in the affinity mask
  int physical = 1;  // distinct cores among them
  double idle = -1;  // idle CPUs among them over the sample (0..logical); < 0: unknown
  double quota = 0;  // the cgroup's CPU quota in CPUs (cpu.max); 0: none
};

// The default team for a machine in this state (pure: the tests give it made-up machines).
int default_cpu_threads(const CpuLoad& load);

// This machine now: the affinity mask, its cores (sysfs topology), the mask's idle time over
// `sample_ms` milliseconds (/proc/stat) and the cgroup v2 quota. What cannot be read is left
// at its "unknown" value, which the default then ignores.
CpuLoad measure_cpu_load(int sample_ms);

}  // namespace kestrel
