#include "storage/run_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <nlohmann/json.hpp>

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
            "jaxtrain/round,jaxtrain/time,epoch,loss,opt/lr\n"
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
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"),
            "jaxtrain/round,jaxtrain/time,a,b\n1,1,2,1\n2,2,3,4\n");
}

TEST(RunStoreTest, MetricsNamedLikeJaxtrainsColumnsKeepTheirValues) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(
      store->AppendRound(1, 10.5, R"({"time":3,"round":7,"step":0,"checkpoint":"c"})").ok());
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"),
            "jaxtrain/round,jaxtrain/time,checkpoint,round,step,time\n"
            "1,10.5,c,7,0,3\n");
  EXPECT_EQ(*ReadFile(dir + "/result.jsonl"),
            "{\"round\":1,\"time\":10.5,\"metrics\":"
            "{\"time\":3,\"round\":7,\"step\":0,\"checkpoint\":\"c\"}}\n");
}

TEST(RunStoreTest, ProgressCsvOfAnEarlierVersionIsContinued) {
  // Before jaxtrain's columns were namespaced, progress.csv began "round,time", and a metric
  // named "time" got a second "time" column that jaxtrain's value overwrote.
  std::string dir = TempDir();
  ASSERT_TRUE(WriteFileAtomically(dir + "/progress.csv", "round,time,loss,time\n1,5,0.5,5\n").ok());
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(store->AppendRound(2, 6, R"({"loss":0.25,"time":42})").ok());
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"), "round,time,loss,time\n1,5,0.5,5\n2,6,0.25,42\n");
}

TEST(RunStoreTest, NonFiniteFloatsFromPythonAreKept) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store->AppendRound(1, 1, R"({"loss":NaN,"g":-Infinity,"s":"NaN \" x"})").ok());
  EXPECT_EQ(
      *ReadFile(dir + "/result.jsonl"),
      "{\"round\":1,\"time\":1,\"metrics\":{\"loss\":NaN,\"g\":-Infinity,\"s\":\"NaN \\\" x\"}}\n");
  EXPECT_EQ(*ReadFile(dir + "/progress.csv"),
            "jaxtrain/round,jaxtrain/time,g,loss,s\n1,1,-Infinity,NaN,\"NaN \"\" x\"\n");
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

TEST(RunStoreTest, ASecondOpenOfALiveRunIsRefusedNamingTheHolder) {
  std::string dir = TempDir();
  auto first = RunStore::Open(dir);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = RunStore::Open(dir);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  const std::string pid = "pid " + std::to_string(getpid());
  EXPECT_NE(second.status().message().find(pid), std::string::npos) << second.status().message();
  EXPECT_NE(second.status().message().find("RunConfig.name"), std::string::npos);
  auto holder = RunStore::LockHolder(dir);
  ASSERT_TRUE(holder.ok());
  ASSERT_TRUE(holder->has_value());
  EXPECT_NE((*holder)->find(pid), std::string::npos) << **holder;
}

TEST(RunStoreTest, UnlockLetsTheNextDriverOpenTheRun) {
  std::string dir = TempDir();
  auto first = RunStore::Open(dir);
  ASSERT_TRUE(first.ok());
  first->Unlock();
  EXPECT_FALSE(RunStore::LockHolder(dir)->has_value());
  auto second = RunStore::Open(dir);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_NE(second->previous_holder().find("pid " + std::to_string(getpid())), std::string::npos);
}

TEST(RunStoreTest, TheLockOfAKilledDriverIsTakenOver) {
  std::string dir = TempDir();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto store = RunStore::Open(dir);
    char c = store.ok() ? 'y' : 'n';
    if (write(ready[1], &c, 1) != 1) _exit(1);
    pause();  // holds the lock until killed
    _exit(0);
  }
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  ASSERT_EQ(c, 'y');
  const std::string child_pid = "pid " + std::to_string(child);
  auto refused = RunStore::Open(dir);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(child_pid), std::string::npos);

  kill(child, SIGKILL);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_FALSE(RunStore::LockHolder(dir)->has_value());
  auto taken = RunStore::Open(dir);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_NE(taken->previous_holder().find(child_pid), std::string::npos)
      << taken->previous_holder();
}

// --- The lease: what keeps a second driver out where locks stay on each host -------------------

std::string ThisHostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

double Now() { return static_cast<double>(std::time(nullptr)); }

void WriteLease(const std::string& dir, const std::string& host, int64_t pid, double heartbeat) {
  ASSERT_TRUE(MakeDirs(dir).ok());
  ASSERT_TRUE(WriteFileAtomically(JoinPath(dir, "LEASE"), nlohmann::json{{"host", host},
                                                                         {"pid", pid},
                                                                         {"since", heartbeat - 100},
                                                                         {"heartbeat", heartbeat}}
                                                              .dump())
                  .ok());
}

bool Exists(int64_t) { return true; }
bool Gone(int64_t) { return false; }

TEST(LeaseTest, ALeaseIsLiveUntilItIsStaleOrItsProcessOnThisHostIsGone) {
  const double now = 1.7e9;
  const double stale = now - kLeaseStaleAfterSeconds;
  auto live = [&](std::string host, int64_t pid, double heartbeat, bool (*exists)(int64_t)) {
    return LeaseIsLive(Lease{.host = host, .pid = pid, .heartbeat = heartbeat}, now, "here", 7,
                       exists);
  };
  EXPECT_TRUE(live("elsewhere", 7, now - 1, Gone));   // another host's pids are not looked at
  EXPECT_TRUE(live("elsewhere", 7, now + 30, Gone));  // its clock runs ahead
  EXPECT_FALSE(live("elsewhere", 7, stale, Exists));
  EXPECT_TRUE(live("here", 8, now - 1, Exists));
  EXPECT_FALSE(live("here", 8, now - 1, Gone));    // killed: its lease is not waited for
  EXPECT_FALSE(live("here", 8, stale, Exists));    // its pid reused by another process
  EXPECT_FALSE(live("here", 7, now - 1, Exists));  // this process's own
}

TEST(LeaseTest, ParsesOnlyWhatALeaseLooksLike) {
  auto lease = ParseLease(R"({"host": "h", "pid": 3, "since": 5, "heartbeat": 6.5})");
  ASSERT_TRUE(lease);
  EXPECT_EQ(lease->host, "h");
  EXPECT_EQ(lease->pid, 3);
  EXPECT_EQ(lease->since, 5);
  EXPECT_EQ(lease->heartbeat, 6.5);
  for (const char* bad :
       {"", "{", "[]", R"({"host": "h", "pid": 3})", R"({"host": 1, "pid": 3, "heartbeat": 1})",
        R"({"host": "h", "pid": "3", "heartbeat": 1})"}) {
    EXPECT_FALSE(ParseLease(bad)) << bad;
  }
}

TEST(LeaseTest, AFreshLeaseFromAnotherHostRefusesASecondDriverThoughTheLockIsFree) {
  std::string dir = TempDir();
  WriteLease(dir, "other-host", 4242, Now() - 2);
  auto refused = RunStore::Open(dir);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  const std::string& message = refused.status().message();
  EXPECT_NE(message.find("in use by another driver (host other-host, pid 4242, since "),
            std::string::npos)
      << message;
  EXPECT_NE(message.find(", lease renewed "), std::string::npos) << message;
  EXPECT_NE(message.find("RunConfig.name"), std::string::npos) << message;
  auto holder = RunStore::LockHolder(dir);
  ASSERT_TRUE(holder.ok() && holder->has_value());
  EXPECT_NE((*holder)->find("host other-host, pid 4242"), std::string::npos) << **holder;
  // The refused driver left the lease as it was.
  EXPECT_NE(ReadFile(JoinPath(dir, "LEASE"))->find("other-host"), std::string::npos);
}

TEST(LeaseTest, AStaleLeaseDoesNotBlockAndTheNewDriverWritesItsOwn) {
  std::string dir = TempDir();
  WriteLease(dir, "other-host", 4242, Now() - kLeaseStaleAfterSeconds - 5);
  EXPECT_FALSE(RunStore::LockHolder(dir)->has_value());
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto lease = ParseLease(*ReadFile(JoinPath(dir, "LEASE")));
  ASSERT_TRUE(lease);
  EXPECT_EQ(lease->host, ThisHostName());
  EXPECT_EQ(lease->pid, getpid());
  EXPECT_GE(lease->heartbeat, Now() - 5);
  store->Unlock();
  EXPECT_FALSE(ReadFile(JoinPath(dir, "LEASE")).ok());  // removed with the lock
}

TEST(LeaseTest, TheLeaseOfAKilledDriverOnThisHostIsNotWaitedFor) {
  std::string dir = TempDir();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  WriteLease(dir, ThisHostName(), child, Now());
  siginfo_t info;  // ended but not reaped: a zombie is no driver either
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  EXPECT_FALSE(RunStore::LockHolder(dir)->has_value());
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_FALSE(RunStore::LockHolder(dir)->has_value());
  auto store = RunStore::Open(dir);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
}

TEST(RunStoreTest, ANewRunHasNoPreviousHolder) {
  auto store = RunStore::Open(TempDir());
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(store->previous_holder(), "");
  EXPECT_FALSE(RunStore::LockHolder(TempDir() + "/missing").value().has_value());
}

TEST(RunStoreTest, ARoundThatCannotBeWrittenWholeIsInNeitherFile) {
  std::string dir = TempDir();
  auto store = RunStore::Open(dir);
  ASSERT_TRUE(store->AppendRound(1, 1, R"({"loss":1})").ok());
  // progress.csv on a device that is always full: the round's line in result.jsonl is undone.
  ASSERT_EQ(unlink((dir + "/progress.csv").c_str()), 0);
  ASSERT_EQ(symlink("/dev/full", (dir + "/progress.csv").c_str()), 0);
  Status s = store->AppendRound(2, 2, R"({"loss":0.5})");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("progress.csv"), std::string::npos) << s.message();
  EXPECT_EQ(*ReadFile(dir + "/result.jsonl"),
            "{\"round\":1,\"time\":1,\"metrics\":{\"loss\":1}}\n");
  EXPECT_EQ(store->LastRound(), 1u);
}

TEST(FilesTest, AFullDiskIsResourceExhaustedNotInternal) {
  Status s = AppendToFile("/dev/full", "x\n");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("/dev/full"), std::string::npos);
}

TEST(FilesTest, TailStartsAtALineBoundary) {
  std::string dir = TempDir();
  ASSERT_TRUE(AppendToFile(dir + "/log", "first line\nsecond line\nthird\n").ok());
  EXPECT_EQ(TailOfFile(dir + "/log", 15), "third\n");
  EXPECT_EQ(TailOfFile(dir + "/missing", 15), "");
}

}  // namespace
}  // namespace jaxtrain::storage
