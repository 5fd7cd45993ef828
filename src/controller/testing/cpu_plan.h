// CpuPlan: the plan of `workers` CPU workers on this (fake) host, for the controller's tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "accelerators/discovery.h"
#include "config/scaling_config.h"
#include "placement/plan.h"

namespace jaxtrain::controller {

inline placement::Plan CpuPlan(int workers) {
  auto config = config::ScalingConfig::Create({.num_workers = workers});
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  accelerators::FakeHost host;
  auto plan = placement::PlanLocal(*config, host);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? *plan : placement::Plan{};
}

// `workers` CPU workers, 2 on each of `hosts` in order.
inline placement::Plan TwoPerHost(int workers, const std::vector<std::string>& hosts) {
  placement::Plan plan = CpuPlan(workers);
  for (auto& w : plan.workers) w.host = hosts[static_cast<size_t>(w.rank / 2)];
  return plan;
}

}  // namespace jaxtrain::controller
