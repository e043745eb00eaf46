#include "engine/cpu_threads.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kestrel {

namespace {

// Busy and idle ticks of each CPU (/proc/stat's "cpuN user nice system idle iowait irq softirq
// steal ..."): iowait is idle (the CPU could run us), steal is busy (the hypervisor gave it to
// another machine).
std::map<int, std::pair<double, double>> cpu_ticks() {
  std::map<int, std::pair<double, double>> out;
  std::ifstream in("/proc/stat");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || !std::isdigit((unsigned char)line[3])) continue;
    std::istringstream s(line.substr(3));
    int cpu = -1;
    double v[8] = {};
    s >> cpu;
    for (double& x : v) s >> x;
    if (!s) continue;
    out[cpu] = {v[0] + v[1] + v[2] + v[5] + v[6] + v[7], v[3] + v[4]};
  }
  return out;
}

int read_int(const std::string& path, int fallback) {
  std::ifstream in(path);
  int v = fallback;
  return in >> v ? v : fallback;
}

}  // namespace

int default_cpu_threads(const CpuLoad& load) {
  const int physical = std::max(1, load.physical);
  int t = physical;
  if (load.idle >= 0 && load.logical > 0) {
    // The cores' worth of idle time: idle CPUs scaled from logical to physical.
    const double idle_cores = std::clamp(load.idle, 0.0, (double)load.logical) * physical / load.logical;
    t = (int)std::floor(idle_cores + 0.5);
  }
  if (load.quota > 0) t = std::min(t, (int)std::floor(load.quota));
  return std::clamp(t, 1, physical);
}

CpuLoad measure_cpu_load(int sample_ms) {
  CpuLoad load;
  cpu_set_t mask;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    load.logical = load.physical = std::max(1u, std::thread::hardware_concurrency());
    return load;
  }
  load.logical = (int)cpus.size();
  std::set<std::pair<int, int>> cores;  // (package, core)
  for (int c : cpus) {
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const int core = read_int(topo + "core_id", -1);
    // A CPU whose core is not told counts as a core of its own.
    cores.insert(core < 0 ? std::make_pair(-1, c) : std::make_pair(read_int(topo + "physical_package_id", 0), core));
  }
  load.physical = (int)cores.size();

  const auto before = cpu_ticks();
  std::this_thread::sleep_for(std::chrono::milliseconds(sample_ms));
  const auto after = cpu_ticks();
  double busy = 0, idle = 0;
  for (int c : cpus) {
    const auto a = before.find(c), b = after.find(c);
    if (a == before.end() || b == after.end()) continue;
    busy += b->second.first - a->second.first;
    idle += b->second.second - a->second.second;
  }
  if (busy + idle > 0) load.idle = idle / (busy + idle) * load.logical;

  // cgroup v2: "max 100000" or "QUOTA PERIOD" (microseconds of CPU per period).
  std::ifstream cpu_max("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (cpu_max >> quota >> period && quota != "max" && period > 0) load.quota = std::stod(quota) / period;
  return load;
}

}  // namespace kestrel
