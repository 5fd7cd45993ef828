#include "config/run_config.h"

#include <gtest/gtest.h>

namespace jaxtrain::config {
namespace {

TEST(RunConfigTest, DefaultNameIsUtcTimestamp) {
  FakeClock clock;  // 1.7e9 s = 2023-11-14 22:13:20 UTC
  auto c = RunConfig::Create({}, clock);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name(), "jaxtrain_run-2023-11-14_22-13-20");
}

TEST(RunConfigTest, DefaultStoragePathIsUnderHome) {
  setenv("HOME", "/home/u", 1);
  auto c = RunConfig::Create({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->storage_path(), "/home/u/jaxtrain_results");
}

TEST(RunConfigTest, KeepsGivenValues) {
  auto c = RunConfig::Create({.name = "exp1", .storage_path = "/mnt/nfs"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name(), "exp1");
  EXPECT_EQ(c->storage_path(), "/mnt/nfs");
}

TEST(RunConfigTest, RejectsNamesThatAreNotOneDirectory) {
  for (const char* bad : {"", ".", "..", "a/b"}) {
    auto c = RunConfig::Create({.name = std::string(bad)});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("RunConfig.name='" + std::string(bad) + "'"),
              std::string::npos);
  }
}

TEST(RunConfigTest, RejectsEmptyStoragePath) {
  auto c = RunConfig::Create({.storage_path = std::string()});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("RunConfig.storage_path=''"), std::string::npos);
}

}  // namespace
}  // namespace jaxtrain::config
