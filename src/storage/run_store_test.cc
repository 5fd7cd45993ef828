#include "storage/run_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "storage/files.h"

namespace jaxtrain::storage {
namespace {

std::string TempDir() {
  char tmpl[] = "/tmp/jaxtrain_store_XXXXXX";
  return mkdtemp(tmpl);
}

TEST(RunStoreTest, CreatesTheRunDirectoryAndLogs) {
  std::string dir = JoinPath(TempDir(), "a/b/run");
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  struct stat st;
  EXPECT_EQ(stat(JoinPath(dir, "logs").c_str(), &st), 0);
  EXPECT_EQ(store->LogPath(3), dir + "/logs/rank-3.log");
}

TEST(RunStoreTest, AppendsRoundsToJsonlAndCsv) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(store->AppendRound(1, 10.5, R"({"loss":0.5,"epoch":0,"opt":{"lr":0.1}})").ok());
  ASSERT_TRUE(store->AppendRound(2, 11.0, R"({"loss":0.25,"epoch":1,"note":"a,b"})").ok());
  EXPECT_EQ(
      *ReadFile(dir + "/result.jsonl"),
      "{\"round\":1,\"time\":10.5,\"metrics\":{\"loss\":0.5,\"epoch\":0,\"opt\":{\"lr\":0.1}}}\n"
      "{\"round\":2,\"time\":11,\"metrics\":{\"loss\":0.25,\"epoch\":1,\"note\":\"a,b\"}}\n");
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"),
            "round,time,epoch,loss,opt/lr\n"
            "1,10.5,0,0.5,0.1\n"
            "2,11,1,0.25,\n");
}

TEST(RunStoreTest, ReopenedStoreKeepsCsvColumns) {
  std::string dir = TempDir();
  {
    auto store = RunStore::Open(dir);
    ASSERT_TRUE(store->AppendRound(1, 1, R"({"b":1,"a":2})").ok());
  }
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store->AppendRound(2, 2, R"({"a":3,"b":4})").ok());
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"), "round,time,a,b\n1,1,2,1\n2,2,3,4\n");
}

TEST(RunStoreTest, NonFiniteFloatsFromPythonAreKept) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store->AppendRound(1, 1, R"({"loss":NaN,"g":-Infinity,"s":"NaN \" x"})").ok());
  EXPECT_EQ(
      *ReadFile(dir + "/result.jsonl"),
      "{\"round\":1,\"time\":1,\"metrics\":{\"loss\":NaN,\"g\":-Infinity,\"s\":\"NaN \\\" x\"}}\n");
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"),
            "round,time,g,loss,s\n1,1,-Infinity,NaN,\"NaN \"\" x\"\n");
}

TEST(RunStoreTest, MetricsMustBeAnObject) {
  auto store = RunStore::Open(TempDir());
  EXPECT_EQ(store->AppendRound(1, 1, "[1,2]").code(), StatusCode::kInvalidArgument);
}

TEST(RunStoreTest, RunStateIsReplacedWhole) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store->WriteRunState({{"status", "RUNNING"}}).ok());
  ASSERT_TRUE(store->WriteRunState({{"status", "FINISHED"}}).ok());
  auto state = nlohmann::json::parse(*ReadFile(dir + "/run.json"));
  EXPECT_EQ(state["status"], "FINISHED");
}

TEST(RunStoreTest, AFileInTheWayIsFailedPrecondition) {
  std::string dir = TempDir();
  ASSERT_TRUE(AppendToFile(dir + "/file", "x").ok());
  auto store = RunStore::Open(dir + "/file/run");
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(store.status().message().find(dir + "/file"), std::string::npos);
}

TEST(FilesTest, TailStartsAtALineBoundary) {
  std::string dir = TempDir();
  ASSERT_TRUE(AppendToFile(dir + "/log", "first line\nsecond line\nthird\n").ok());
  EXPECT_EQ(TailOfFile(dir + "/log", 15), "third\n");
  EXPECT_EQ(TailOfFile(dir + "/missing", 15), "");
}

}  // namespace
}  // namespace jaxtrain::storage
