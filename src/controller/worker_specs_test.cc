#include "controller/worker_specs.h"

#include <gtest/gtest.h>

namespace jaxtrain::controller {
namespace {

using Env = std::map<std::string, std::string>;

placement::WorkerPlacement Worker(int rank, int local_rank, int local_world_size, int node_rank) {
  return {.rank = rank,
          .local_rank = local_rank,
          .local_world_size = local_world_size,
          .node_rank = node_rank};
}

WorkerCommand Command() {
  return {.argv = {"/usr/bin/python3", "-m", "jaxtrain.worker"},
          .cwd = "/work",
          .env = {{"USER_SETTING", "1"}},
          .controller_address = "10.0.0.1:4000",
          .run_dir = "/runs/exp",
          .experiment_name = "exp",
          .secret_hex = "00ff"};
}

TEST(BuildWorkerSpecsTest, GivesEveryRankTheCommandAndTheRunsSharedEnvironment) {
  placement::Plan plan{.platform = "cpu", .workers = {Worker(0, 0, 2, 0), Worker(1, 1, 2, 0)}};
  WorkerSpecs out = BuildWorkerSpecs(plan, Command());
  ASSERT_EQ(out.specs.size(), 2u);
  EXPECT_EQ(*out.shared_env, (Env{{"USER_SETTING", "1"},
                                  {"JAXTRAIN_CONTROLLER_ADDR", "10.0.0.1:4000"},
                                  {"JAXTRAIN_WORLD_SIZE", "2"},
                                  {"JAXTRAIN_RUN_DIR", "/runs/exp"},
                                  {"JAXTRAIN_EXPERIMENT_NAME", "exp"},
                                  {"JAXTRAIN_PLATFORM", "cpu"},
                                  {"JAXTRAIN_LOCAL_WORLD_SIZE", "2"},
                                  {"JAXTRAIN_NODE_RANK", "0"}}));
  for (int rank = 0; rank < 2; ++rank) {
    const launch::ProcessSpec& spec = out.specs[static_cast<size_t>(rank)];
    EXPECT_EQ(spec.ranks, std::vector<int>{rank});
    EXPECT_EQ(spec.argv, Command().argv);
    EXPECT_EQ(spec.cwd, "/work");
    EXPECT_EQ(spec.secret, "00ff");
    EXPECT_EQ(spec.shared_env, out.shared_env);  // held once for all
    // Only what differs between the workers is their own.
    EXPECT_EQ(spec.env, (Env{{"JAXTRAIN_RANK", std::to_string(rank)},
                             {"JAXTRAIN_LOCAL_RANK", std::to_string(rank)}}));
  }
}

TEST(BuildWorkerSpecsTest, NumbersThatDifferBetweenWorkersAreEachWorkersOwn) {
  placement::Plan plan{.platform = "tpu",
                       .workers = {Worker(0, 0, 1, 0), Worker(1, 0, 2, 1), Worker(2, 1, 2, 1)}};
  WorkerSpecs out = BuildWorkerSpecs(plan, Command());
  EXPECT_FALSE(out.shared_env->count("JAXTRAIN_LOCAL_RANK"));
  EXPECT_FALSE(out.shared_env->count("JAXTRAIN_LOCAL_WORLD_SIZE"));
  EXPECT_FALSE(out.shared_env->count("JAXTRAIN_NODE_RANK"));
  EXPECT_EQ(out.shared_env->at("JAXTRAIN_WORLD_SIZE"), "3");
  ASSERT_EQ(out.specs.size(), 3u);
  EXPECT_EQ(out.specs[2].env, (Env{{"JAXTRAIN_RANK", "2"},
                                   {"JAXTRAIN_LOCAL_RANK", "1"},
                                   {"JAXTRAIN_LOCAL_WORLD_SIZE", "2"},
                                   {"JAXTRAIN_NODE_RANK", "1"}}));
}

TEST(BuildWorkerSpecsTest, APlansEntryOfASharedNameGivesWayToTheSharedOne) {
  placement::WorkerPlacement w = Worker(0, 0, 1, 0);
  w.env = {{"TPU_WORKER_ID", "0"}, {"JAXTRAIN_PLATFORM", "gpu"}, {"USER_SETTING", "2"}};
  w.unset_env = {"CUDA_VISIBLE_DEVICES"};
  WorkerSpecs out = BuildWorkerSpecs({.platform = "cpu", .workers = {w}}, Command());
  ASSERT_EQ(out.specs.size(), 1u);
  EXPECT_EQ(out.specs[0].env, (Env{{"TPU_WORKER_ID", "0"}, {"JAXTRAIN_RANK", "0"}}));
  EXPECT_EQ(out.specs[0].unset_env, std::vector<std::string>{"CUDA_VISIBLE_DEVICES"});
  Env env = out.specs[0].Env();
  EXPECT_EQ(env.at("JAXTRAIN_PLATFORM"), "cpu");
  EXPECT_EQ(env.at("USER_SETTING"), "1");
}

}  // namespace
}  // namespace jaxtrain::controller
