// The CPU engine's default threads (engine/cpu_threads.h) for made-up machines: the physical
// cores of the affinity mask, fewer when other programs keep some busy, never past the cgroup's
// quota, never below 1.
#include <gtest/gtest.h>

#include "engine/cpu_threads.h"

using kestrel::CpuLoad;
using kestrel::default_cpu_threads;

TEST(CpuThreads, IdleMachineGetsItsPhysicalCores) {
  EXPECT_EQ(default_cpu_threads({2, 2, 2.0, 0}), 2);
  EXPECT_EQ(default_cpu_threads({16, 8, 16.0, 0}), 8);  // SMT: two CPUs a core, one thread a core
  EXPECT_EQ(default_cpu_threads({1, 1, 1.0, 0}), 1);
}

TEST(CpuThreads, BusyCoresAreLeftToTheirPrograms) {
  EXPECT_EQ(default_cpu_threads({2, 2, 0.0, 0}), 1);   // both busy: one thread, not zero
  EXPECT_EQ(default_cpu_threads({2, 2, 1.0, 0}), 1);   // one busy
  EXPECT_EQ(default_cpu_threads({2, 2, 1.6, 0}), 2);   // a light load rounds away
  EXPECT_EQ(default_cpu_threads({8, 8, 5.0, 0}), 5);
  EXPECT_EQ(default_cpu_threads({16, 8, 8.0, 0}), 4);  // half the CPUs idle: half the cores
  EXPECT_EQ(default_cpu_threads({4, 4, 9.0, 0}), 4);   // an idle count past the mask is clamped
}

TEST(CpuThreads, QuotaBoundsTheTeam) {
  EXPECT_EQ(default_cpu_threads({8, 8, 8.0, 2.5}), 2);
  EXPECT_EQ(default_cpu_threads({8, 8, 8.0, 0.5}), 1);
  EXPECT_EQ(default_cpu_threads({4, 4, 4.0, 16}), 4);
}

TEST(CpuThreads, UnknownIdleTimeGivesTheCores) {
  EXPECT_EQ(default_cpu_threads({4, 4, -1, 0}), 4);
  EXPECT_EQ(default_cpu_threads({4, 0, -1, 0}), 1);  // no core count read: still one thread
}

// The measured machine is a machine the default can use: at least one CPU, cores no more than
// CPUs, idle time within the mask.
TEST(CpuThreads, MeasuredLoadIsConsistent) {
  const CpuLoad l = kestrel::measure_cpu_load(20);
  EXPECT_GE(l.logical, 1);
  EXPECT_GE(l.physical, 1);
  EXPECT_LE(l.physical, l.logical);
  EXPECT_LE(l.idle, l.logical + 1e-9);
  const int t = default_cpu_threads(l);
  EXPECT_GE(t, 1);
  EXPECT_LE(t, l.physical);
}
