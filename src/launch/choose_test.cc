#include "launch/choose.h"

#include <gtest/gtest.h>

#include <string>

#include "launch/ssh_launcher.h"

namespace jaxtrain::launch {
namespace {

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(ChooseLauncherTest, SlurmInsideAnAllocationLocalElsewhereUnlessSetExplicitly) {
  accelerators::FakeHost host;
  EXPECT_EQ(*ChooseLauncher(host), LauncherKind::kLocal);
  host.env["SLURM_JOB_ID"] = "12";
  EXPECT_EQ(*ChooseLauncher(host), LauncherKind::kSlurm);
  host.env[kLauncherEnv] = "local";
  EXPECT_EQ(*ChooseLauncher(host), LauncherKind::kLocal);
  host.env.erase("SLURM_JOB_ID");
  host.env[kLauncherEnv] = "slurm";
  EXPECT_EQ(*ChooseLauncher(host), LauncherKind::kSlurm);
  host.env[kLauncherEnv] = "k8s";
  auto bad = ChooseLauncher(host);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "JAXTRAIN_LAUNCHER='k8s'"));
}

TEST(ChooseLauncherTest, ListedHostsChooseSsh) {
  accelerators::FakeHost env;
  env.env[kSshHostsEnv] = "h1";
  EXPECT_EQ(*ChooseLauncher(env), LauncherKind::kSsh);
  env.env[kLauncherEnv] = "local";
  EXPECT_EQ(*ChooseLauncher(env), LauncherKind::kLocal);
  env.env.clear();
  env.env[kLauncherEnv] = "ssh";
  EXPECT_EQ(*ChooseLauncher(env), LauncherKind::kSsh);
}

TEST(LauncherKindTest, NamesParseBackAndOthersAreRefusedNamingTheField) {
  for (auto kind : {LauncherKind::kLocal, LauncherKind::kSsh, LauncherKind::kSlurm,
                    LauncherKind::kKubernetes}) {
    EXPECT_EQ(*ParseLauncherKind(LauncherKindName(kind), "launcher"), kind);
  }
  auto bad = ParseLauncherKind("k8s", "launcher");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "launcher='k8s' is not allowed"));
  accelerators::FakeHost host;
  host.env[kLauncherEnv] = "kubernetes";
  EXPECT_EQ(*ChooseLauncher(host), LauncherKind::kKubernetes);
}

}  // namespace
}  // namespace jaxtrain::launch
