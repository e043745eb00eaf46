// What the CPU engine chooses when not told, for made-up machines: its threads
// (engine/cpu_threads.h: the physical cores of the affinity mask, fewer when other programs
// keep some busy, never past the cgroup's quota, never below 1) and its context
// (engine/loader.h's fit_context: the model's, shortened to what half the memory left holds).
#include <gtest/gtest.h>

#include <climits>

#include "engine/cpu_threads.h"
#include "engine/loader.h"

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

using kestrel::fit_context;

// 1,000 bytes a position and 1,000,000 bytes of room: -c may take 1,000 positions, the default
// 500 (half the room).
TEST(ContextFit, DefaultTakesHalfTheRoom) {
  const auto small = fit_context(0, 100, 1000, 1e6, 0.5);
  EXPECT_EQ(small.context, 100);  // the model's own fits: kept
  const auto huge = fit_context(0, INT_MAX, 1000, 1e6, 0.5);
  EXPECT_EQ(huge.context, 500);   // under 512: taken as it is
  EXPECT_EQ(huge.fits, 1000);
  EXPECT_EQ(fit_context(0, INT_MAX, 1000, 1e7, 0.5).context, 4864);  // 5,000 down to 19 * 256
  EXPECT_EQ(fit_context(0, 600, 1000, 1e6, 0.5).context, 500);       // never past half ...
  EXPECT_EQ(fit_context(0, 499, 1000, 1e6, 0.5).context, 499);       // ... nor past the model's
}

TEST(ContextFit, AskedContextIsWholeOrNothing) {
  EXPECT_EQ(fit_context(900, 100, 1000, 1e6, 0.5).context, 900);  // past half: -c may
  EXPECT_EQ(fit_context(1000, 100, 1000, 1e6, 0.5).context, 1000);
  const auto over = fit_context(1001, 100, 1000, 1e6, 0.5);
  EXPECT_EQ(over.context, 0);
  EXPECT_EQ(over.fits, 1000);
}

TEST(ContextFit, NoRoomFitsNothing) {
  EXPECT_EQ(fit_context(0, INT_MAX, 1000, 31e3, 0.5).context, 0);  // 15 positions: under 16
  EXPECT_EQ(fit_context(0, INT_MAX, 1000, 32e3, 0.5).context, 16);
  EXPECT_EQ(fit_context(0, 8, 1000, -5e6, 0.5).context, 0);  // the weights alone overflow
  EXPECT_EQ(fit_context(0, 8, 1000, -5e6, 0.5).fits, 0);
  // Positions past int: the room of a large machine for a tiny cache.
  EXPECT_EQ(fit_context(0, INT_MAX, 8, 1e12, 0.5).context, INT_MAX);
}
