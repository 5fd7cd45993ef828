// The Slurm launcher without Slurm: its pure parts as functions, and Launch() and the controller
// against a fake srun (a shell script that runs --ntasks copies of the command with SLURM_PROCID
// set, labels their lines "<task>: " and reports a failed task as srun does) over fake_worker
// processes. tests/test_slurm.py runs the real thing on a real cluster.
#include "launch/slurm_launcher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "controller/controller.h"

namespace jaxtrain::launch {
namespace {

using Strings = std::vector<std::string>;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

config::ScalingConfig Config(config::ScalingConfigInput input) {
  auto c = config::ScalingConfig::Create(std::move(input));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(SlurmShapeTest, CpuWorkersAreTasksOfOneCpuEach) {
  accelerators::FakeHost host;
  auto shape = SlurmShapeFor(Config({.num_workers = 4}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1"}));
  EXPECT_EQ(shape->SallocArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1", "--signal=USR1@90"}));
  EXPECT_EQ(shape->Describe(), "4 tasks, 1 CPU each");
}

TEST(SlurmShapeTest, TheTimeLimitSignalIsAskedForByAllocationsOnly) {
  accelerators::FakeHost host;
  host.env[kSlurmSignalEnv] = "120";
  auto shape = SlurmShapeFor(Config({.num_workers = 2}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->signal_s, 120);
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=2", "--cpus-per-task=1"}));
  EXPECT_EQ(shape->SallocArgs(), (Strings{"--ntasks=2", "--cpus-per-task=1", "--signal=USR1@120"}));
  host.env[kSlurmSignalEnv] = "0";
  EXPECT_EQ(SlurmShapeFor(Config({.num_workers = 2}), host)->SallocArgs(),
            (Strings{"--ntasks=2", "--cpus-per-task=1"}));
  for (const char* bad : {"-1", "1.5", "65536", "soon"}) {
    host.env[kSlurmSignalEnv] = bad;
    auto refused = SlurmShapeFor(Config({.num_workers = 2}), host);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(
        Contains(refused.status().message(), std::string("JAXTRAIN_SLURM_SIGNAL_S='") + bad + "'"))
        << refused.status().message();
  }
}

TEST(SlurmShapeTest, PlacementStrategiesBecomeNodeCountsAndDistributions) {
  accelerators::FakeHost host;
  auto spread = SlurmShapeFor(Config({.num_workers = 4, .placement_strategy = "SPREAD"}), host);
  EXPECT_EQ(spread->SrunArgs(),
            (Strings{"--ntasks=4", "--cpus-per-task=1", "--distribution=cyclic"}));
  EXPECT_EQ(spread->SallocArgs(),
            (Strings{"--ntasks=4", "--cpus-per-task=1", "--spread-job", "--signal=USR1@90"}));
  auto strict_spread =
      SlurmShapeFor(Config({.num_workers = 3, .placement_strategy = "STRICT_SPREAD"}), host);
  EXPECT_EQ(strict_spread->SrunArgs(),
            (Strings{"--ntasks=3", "--cpus-per-task=1", "--nodes=3", "--ntasks-per-node=1"}));
  auto strict_pack =
      SlurmShapeFor(Config({.num_workers = 3, .placement_strategy = "STRICT_PACK"}), host);
  EXPECT_EQ(strict_pack->SrunArgs(),
            (Strings{"--ntasks=3", "--cpus-per-task=1", "--nodes=1", "--ntasks-per-node=3"}));
}

TEST(SlurmShapeTest, ResourcesPerWorkerBecomeCpusAndGpusPerTask) {
  accelerators::FakeHost host;
  auto shape = SlurmShapeFor(
      Config(
          {.num_workers = 2, .use_gpu = true, .resources_per_worker = {{"GPU", 2}, {"CPU", 3.5}}}),
      host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=2", "--cpus-per-task=4", "--gpus-per-task=2"}));
  EXPECT_EQ(shape->Describe(), "2 tasks, 4 CPUs and 2 GPUs each");

  auto half = SlurmShapeFor(
      Config({.num_workers = 2, .use_gpu = true, .resources_per_worker = {{"GPU", 0.5}}}), host);
  EXPECT_EQ(half.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(half.status().message(), "resources_per_worker['GPU']=0.5"));
}

TEST(SlurmShapeTest, NodeFeaturesConstrainTheAllocationAndEveryStep) {
  accelerators::FakeHost host;
  host.env[kSlurmConstraintEnv] = "h100&(ib|roce)";
  auto shape = SlurmShapeFor(Config({.num_workers = 4, .placement_strategy = "SPREAD"}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1",
                                        "--constraint=h100&(ib|roce)", "--distribution=cyclic"}));
  EXPECT_EQ(shape->SallocArgs(),
            (Strings{"--ntasks=4", "--cpus-per-task=1", "--constraint=h100&(ib|roce)",
                     "--spread-job", "--signal=USR1@90"}));
  EXPECT_EQ(shape->Describe(), "4 tasks, 1 CPU each, nodes with h100&(ib|roce)");
  host.env[kSlurmConstraintEnv] = "";
  EXPECT_EQ(SlurmShapeFor(Config({.num_workers = 4}), host)->SrunArgs(),
            (Strings{"--ntasks=4", "--cpus-per-task=1"}));
}

TEST(SlurmShapeTest, ATpuSliceTakesWholeHostsUnlessSimulated) {
  accelerators::FakeHost host;
  auto config =
      Config({.num_workers = 4, .use_tpu = true, .topology = "4x4", .accelerator_type = "TPU-V6E"});
  auto shape = SlurmShapeFor(config, host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1", "--nodes=4",
                                        "--ntasks-per-node=1", "--exclusive"}));
  host.env[placement::kSimulateEnv] = "1";
  EXPECT_EQ(SlurmShapeFor(config, host)->SrunArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1"}));
}

TEST(SlurmShapeTest, SettingsOverrideTheShapeAndAreChecked) {
  accelerators::FakeHost host;
  host.env[kSlurmNodesEnv] = "2";
  host.env[kSlurmTasksPerNodeEnv] = "2";
  host.env[kSlurmExclusiveEnv] = "1";
  auto shape = SlurmShapeFor(Config({.num_workers = 4}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SrunArgs(), (Strings{"--ntasks=4", "--cpus-per-task=1", "--nodes=2",
                                        "--ntasks-per-node=2", "--exclusive"}));

  host.env[kSlurmTasksPerNodeEnv] = "3";
  auto mismatch = SlurmShapeFor(Config({.num_workers = 4}), host);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(mismatch.status().message(), "2 nodes x 3 tasks per node"));

  host.env[kSlurmNodesEnv] = "two";
  auto garbled = SlurmShapeFor(Config({.num_workers = 4}), host);
  EXPECT_EQ(garbled.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(garbled.status().message(), "JAXTRAIN_SLURM_NODES='two'"));

  host.env.erase(kSlurmTasksPerNodeEnv);
  host.env[kSlurmNodesEnv] = "5";
  EXPECT_EQ(SlurmShapeFor(Config({.num_workers = 4}), host).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(StartSlurmTest, InTheDriversAllocationWithAListenHostSlurmIsNotAsked) {
  accelerators::FakeHost host;
  host.env["SLURM_JOB_ID"] = "4242";
  host.env[kListenHostEnv] = "10.1.2.3";
  bool asked = false;
  auto started = StartSlurm(Config({.num_workers = 2}), host, "jaxtrain-t", [&] {
    asked = true;
    return true;
  });
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  EXPECT_NE(started->launcher, nullptr);
  EXPECT_EQ(started->listen_host, "10.1.2.3");
  EXPECT_FALSE(asked);  // no allocation was requested, so nothing waited
}

TEST(StartSlurmTest, ABadShapeIsRefusedBeforeAnyAllocationIsRequested) {
  accelerators::FakeHost host;  // no SLURM_JOB_ID: an allocation would be requested
  host.env[kSlurmNodesEnv] = "0";
  bool asked = false;
  auto started = StartSlurm(Config({.num_workers = 2}), host, "jaxtrain-t", [&] {
    asked = true;
    return true;
  });
  EXPECT_EQ(started.status().code(), StatusCode::kInvalidArgument) << started.status().ToString();
  EXPECT_TRUE(Contains(started.status().message(), "JAXTRAIN_SLURM_NODES='0'"))
      << started.status().message();
  EXPECT_FALSE(asked);
}

TEST(PlanForSlurmTest, OneEnvironmentForEveryRankAndNoDevices) {
  accelerators::FakeHost host;
  auto cpu = PlanForSlurm(Config({.num_workers = 3}), host);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_EQ(cpu->platform, "cpu");
  ASSERT_EQ(cpu->workers.size(), 3u);
  for (const auto& w : cpu->workers) {
    EXPECT_EQ(w.env,
              (std::map<std::string, std::string>{{"JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo"},
                                                  {"JAX_NUM_CPU_DEVICES", "1"},
                                                  {"JAX_PLATFORMS", "cpu"}}));
    EXPECT_TRUE(w.devices.empty());
  }
  auto gpu = PlanForSlurm(Config({.num_workers = 2, .use_gpu = true}), host);
  EXPECT_EQ(gpu->platform, "cuda");
  EXPECT_EQ(gpu->workers[1].env, (std::map<std::string, std::string>{{"JAX_PLATFORMS", "cuda"}}));
  host.env[placement::kSimulateEnv] = "1";
  EXPECT_EQ(PlanForSlurm(Config({.num_workers = 2, .use_gpu = true}), host)->platform, "cpu");
}

// Elastic runs (docs/elastic.md): whole nodes of a known number of tasks are asked for as a node
// range; every elastic allocation survives a node's failure (--no-kill).
TEST(SlurmShapeTest, AnElasticRangeAsksForANodeRangeAndNoKill) {
  accelerators::FakeHost host;
  host.env[kSlurmTasksPerNodeEnv] = "2";
  auto shape = SlurmShapeFor(Config({.num_workers = 4, .min_workers = 2}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SallocArgs(), (Strings{"--cpus-per-task=1", "--nodes=1-2", "--ntasks-per-node=2",
                                          "--no-kill", "--signal=USR1@90"}));
  EXPECT_EQ(shape->Describe(), "2 to 4 tasks on 1 to 2 nodes, 2 per node, 1 CPU each");

  host.env.erase(kSlurmTasksPerNodeEnv);  // max tasks, and the nodes Slurm gives set the unit
  shape = SlurmShapeFor(Config({.num_workers = 4, .min_workers = 2}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->SallocArgs(),
            (Strings{"--ntasks=4", "--cpus-per-task=1", "--no-kill", "--signal=USR1@90"}));

  host.env[kSlurmNodesEnv] = "2";
  shape = SlurmShapeFor(Config({.num_workers = 4, .min_workers = 4}), host);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  EXPECT_EQ(shape->tasks_per_node, 2);
  EXPECT_EQ(shape->min_nodes, 2);
  EXPECT_EQ(shape->SallocArgs()[0], "--ntasks=4") << "min = max: no range";
}

TEST(SlurmShapeTest, AnElasticRangeOfPartNodesOrTpusIsRefused) {
  accelerators::FakeHost host;
  host.env[kSlurmTasksPerNodeEnv] = "2";
  auto shape = SlurmShapeFor(Config({.num_workers = 4, .min_workers = 3}), host);
  EXPECT_EQ(shape.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(shape.status().message(),
            "ScalingConfig.num_workers=(3, 4) is not allowed with 2 task(s) per node: an elastic "
            "run on Slurm grows and shrinks by whole nodes; allowed: min and max multiples of 2");
  host.env.erase(kSlurmTasksPerNodeEnv);
  host.env[kSlurmNodesEnv] = "3";
  shape = SlurmShapeFor(Config({.num_workers = 4, .min_workers = 2}), host);
  EXPECT_TRUE(Contains(shape.status().message(), "JAXTRAIN_SLURM_NODES=3"))
      << shape.status().ToString();
}

TEST(PlanForSlurmNodesTest, PutsTheSameNumberOfRanksOnEachNodeInBlocks) {
  accelerators::FakeHost host;
  const config::ScalingConfig config = Config({.num_workers = 4, .min_workers = 2});
  auto uniform = PlanForSlurm(config, host);
  ASSERT_TRUE(uniform.ok());
  auto full = PlanForSlurmNodes(config, *uniform, {"node1", "node2"}, {}, "42");
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  ASSERT_EQ(full->workers.size(), 4u);
  EXPECT_EQ(full->hosts_source, "Slurm job 42's nodes node1,node2");
  for (const auto& w : full->workers) {
    EXPECT_EQ(w.host, w.rank < 2 ? "node1" : "node2");
    EXPECT_EQ(w.local_rank, w.rank % 2);
    EXPECT_EQ(w.local_world_size, 2);
    EXPECT_EQ(w.env, uniform->workers[0].env);
  }
  // A node range granted one node: the run holds its workers, min at least.
  auto one = PlanForSlurmNodes(config, *uniform, {"node1"}, {.tasks_per_node = 2}, "42");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->workers.size(), 2u);
  auto uneven = PlanForSlurmNodes(config, *uniform, {"n1", "n2", "n3"}, {}, "42");
  EXPECT_EQ(uneven.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(uneven.status().message(),
                       "3 nodes do not divide 4; set "
                       "JAXTRAIN_SLURM_TASKS_PER_NODE"));
  auto odd = PlanForSlurmNodes(Config({.num_workers = 4, .min_workers = 1}), *uniform,
                               {"node1", "node2"}, {}, "42");
  EXPECT_TRUE(Contains(odd.status().message(), "each host takes 2 worker(s)"))
      << odd.status().ToString();
}

TEST(SlurmNodesTest, ReadsScontrolsStatesAndReasons) {
  auto nodes = ParseSlurmNodes(
      "NodeName=node1 Arch=x86_64 CoresPerSocket=1 State=MIXED ThreadsPerCore=1\n"
      "NodeName=node2 Arch=x86_64 State=MIXED+DRAIN Weight=1 Reason=disk is bad "
      "[root@2026-12-06T11:00:00]\n"
      "NodeName=node3 State=DOWN+NOT_RESPONDING Reason=Not responding [slurm@2026-12-06]\n");
  ASSERT_EQ(nodes.size(), 3u);
  EXPECT_EQ(nodes["node1"].state, "MIXED");
  EXPECT_EQ(nodes["node1"].reason, "");
  EXPECT_EQ(nodes["node2"].state, "MIXED+DRAIN");
  EXPECT_EQ(nodes["node2"].reason, "disk is bad");
  EXPECT_EQ(nodes["node3"].reason, "Not responding");
  for (const char* usable : {"IDLE", "MIXED", "ALLOCATED", "ALLOCATED+COMPLETING", "IDLE+CLOUD"}) {
    EXPECT_TRUE(SlurmNodeUsable(usable)) << usable;
  }
  for (const char* not_usable :
       {"IDLE+DRAIN", "MIXED+DRAIN", "DRAINED", "DRAINING", "DOWN", "DOWN+NOT_RESPONDING",
        "IDLE+FAIL", "ALLOCATED+FAILING", "IDLE*", "", "MIXED+POWERING_DOWN", "IDLE+POWERED_DOWN",
        "ALLOCATED+REBOOT_REQUESTED", "MIXED+REBOOT_ISSUED", "IDLE+INVALID_REG", "FUTURE",
        "UNKNOWN"}) {
    EXPECT_FALSE(SlurmNodeUsable(not_usable)) << not_usable;
  }
}

TEST(ParseSrunTaskEndTest, ReadsSignalsExitCodesAndTaskRanges) {
  auto killed = ParseSrunTaskEnd("srun: error: node2: task 3: Killed\n");
  ASSERT_TRUE(killed.has_value());
  EXPECT_EQ(killed->tasks, std::vector<int>{3});
  EXPECT_EQ(killed->node, "node2");
  EXPECT_EQ(killed->exit.signal, SIGKILL);

  auto exited = ParseSrunTaskEnd("srun: error: node1: tasks 0-1,4: Exited with exit code 3");
  ASSERT_TRUE(exited.has_value());
  EXPECT_EQ(exited->tasks, (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(exited->exit.exit_code, 3);
  EXPECT_EQ(exited->exit.signal, 0);

  auto segv = ParseSrunTaskEnd("srun: error: n7: task 0: Segmentation fault (core dumped)");
  ASSERT_TRUE(segv.has_value());
  EXPECT_EQ(segv->exit.signal, SIGSEGV);
  EXPECT_TRUE(segv->exit.core_dumped);

  for (const char* other :
       {"srun: error: Unable to create step for job 12: Invalid",
        "0: srun: error: node2: task 1: Killed", "srun: error: node2: task x: Killed",
        "srun: error: node2: task 1: Something else", "hello"}) {
    EXPECT_FALSE(ParseSrunTaskEnd(other).has_value()) << other;
  }
}

TEST(ParseSlurmTimeLeftTest, ReadsSqueuesFormsOfTimeLeft) {
  EXPECT_EQ(ParseSlurmTimeLeft("1:38\n"), 98);
  EXPECT_EQ(ParseSlurmTimeLeft("0:05"), 5);
  EXPECT_EQ(ParseSlurmTimeLeft("2:01:40"), 7300);
  EXPECT_EQ(ParseSlurmTimeLeft("1-00:00:10"), 86410);
  EXPECT_EQ(ParseSlurmTimeLeft("3-04"), 3 * 86400 + 4 * 3600);
  for (const char* other : {"UNLIMITED", "NOT_SET", "INVALID", "", "12", "1:x", "1:2:3:4"}) {
    EXPECT_FALSE(ParseSlurmTimeLeft(other).has_value()) << other;
  }
}

class TempDirTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string dir = testing::TempDir() + "/slurm_launcher_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes an executable script.
  std::string Script(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    chmod(path.c_str(), 0755);
    return path;
  }

  std::string dir_;
};

using CheckSharedStorageTest = TempDirTest;

TEST_F(CheckSharedStorageTest, ALocalDirectoryIsRefusedUnlessDeclaredShared) {
  struct statfs st {};
  ASSERT_EQ(statfs(dir_.c_str(), &st), 0);
  if (st.f_type == 0x6969) GTEST_SKIP() << "the test's temporary directory is on NFS";
  accelerators::FakeHost host;
  Status refused = CheckSharedStorage(dir_ + "/runs/not-yet", host);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(refused.message(), "'" + dir_ + "/runs/not-yet' is on a local filesystem"));
  EXPECT_TRUE(Contains(refused.message(), "use shared storage"));
  EXPECT_TRUE(Contains(refused.message(), "s3://, gs://"));

  host.env[kSharedStorageEnv] = "/nonexistent/a:" + dir_ + "/runs";
  EXPECT_TRUE(CheckSharedStorage(dir_ + "/runs/not-yet", host).ok());
  EXPECT_TRUE(CheckSharedStorage(dir_ + "/runs", host).ok());
  EXPECT_FALSE(CheckSharedStorage(dir_ + "/runs-other", host).ok());  // a sibling, not inside
}

TEST(AddressTowardsTest, IsTheSourceAddressOfTheRoute) {
  EXPECT_EQ(*AddressTowards("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(AddressTowards("no-such-host.invalid").status().code(), StatusCode::kUnavailable);
}

// srun's behaviour that the launcher and the controller rely on, for tests: --ntasks copies of
// the command with SLURM_PROCID (and, as python/jaxtrain/worker/entry.py derives them,
// JAXTRAIN_RANK
// ...), each line labelled "<task>: " with --label, all of its stdin given to every task
// (--input=all); every task that fails is reported as srun reports it, and the first one's failure
// kills the others (--kill-on-bad-exit); a SIGTERM, which the tasks get as well, does not stop it
// from reporting. Its arguments go to $FAKE_SRUN_ARGS. With $FAKE_SRUN_REMOTE set, the tasks are
// as on other nodes: outside srun's process group, killed with SIGKILL when srun gets SIGTERM (as
// srun's "forcing job termination"), and their ends reported in the order of their task numbers,
// whatever the order of the ends, as the messages of several nodes may race.
constexpr char kFakeSrun[] = R"(#!/usr/bin/python3
import os, signal, subprocess, sys, threading

remote = bool(os.environ.get("FAKE_SRUN_REMOTE"))
tasks, running = {}, set()
# Like srun, outlive a SIGTERM (the tasks get it too, or SIGKILL when remote) to report how the
# tasks ended.
def on_sigterm(*_):
    for pid in running if remote else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # reaped, not yet discarded
            pass


signal.signal(signal.SIGTERM, on_sigterm)

with open(os.environ["FAKE_SRUN_ARGS"], "w") as f:
    f.write("\n".join(sys.argv[1:]) + "\n")
args, n, labelled, broadcast = sys.argv[1:], 1, False, False
while args and args[0].startswith("--"):
    arg = args.pop(0)
    labelled = labelled or arg == "--label"
    broadcast = broadcast or arg == "--input=all"
    if arg.startswith("--ntasks="):
        n = int(arg.split("=", 1)[1])
    elif arg.startswith("--chdir="):
        os.chdir(arg.split("=", 1)[1])
# --input=all: every task reads all of srun's stdin (the run's secret, a standby's activation) as
# it comes, not a share of one pipe.
inputs = []
lock = threading.Lock()


def broadcast_stdin():
    while chunk := os.read(0, 65536):
        for w in inputs:
            try:
                os.write(w, chunk)
            except OSError:
                pass
    for w in inputs:
        os.close(w)


def label(i, out):
    for line in out:
        with lock:
            sys.stdout.write(f"{i}: {line}" if labelled else line)
            sys.stdout.flush()


pumps = []
for i in range(n):
    place = {"SLURM_PROCID": i, "SLURM_LOCALID": i, "SLURM_NODEID": 0, "JAXTRAIN_RANK": i,
             "JAXTRAIN_LOCAL_RANK": i, "JAXTRAIN_LOCAL_WORLD_SIZE": n, "JAXTRAIN_NODE_RANK": 0}
    env = dict(os.environ, **{k: str(v) for k, v in place.items()})
    r, w = os.pipe()
    if broadcast:
        inputs.append(w)
    else:
        os.close(w)
    p = subprocess.Popen(args, env=env, stdin=r, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=remote)
    os.close(r)
    tasks[p.pid] = (i, p)
    running.add(p.pid)
    pumps.append(threading.Thread(target=label, args=(i, p.stdout)))
    pumps[-1].start()
threading.Thread(target=broadcast_stdin, daemon=True).start()
rc, ends = 0, []
while running:
    pid, status = os.wait()
    running.discard(pid)
    i, p = tasks[pid]
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        continue
    what = f"Exited with exit code {code}" if code > 0 else signal.strsignal(-code)
    ends.append((i, f"srun: error: fakehost: task {i}: {what}\n"))
    if rc == 0:
        rc = code if code > 0 else 128 - code
        for other in [] if remote else running:  # remote: killed by the stop's SIGTERM
            os.kill(other, signal.SIGKILL)  # not Popen.kill(), which would reap it here
with lock:
    sys.stderr.writelines(line for _, line in (sorted(ends) if remote else ends))
    sys.stderr.flush()
for t in pumps:
    t.join()
sys.exit(rc)
)";

class SlurmLauncherTest : public TempDirTest {
 protected:
  SlurmLauncherOptions Options(const std::string& state = "RUNNING None") {
    setenv("FAKE_SRUN_ARGS", (dir_ + "/srun-args").c_str(), 1);
    return {.job_id = "42",
            .shape = {.tasks = 2},
            .step_name = "jaxtrain-test",
            .srun = Script("srun", kFakeSrun),
            .scancel = Script("scancel", "#!/bin/sh\necho \"$@\" >> " + dir_ + "/scancel-args\n"),
            .squeue = Script("squeue", "#!/bin/sh\necho '" + state + "'\n")};
  }
};

std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 10000);
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EAGAIN) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

TEST_F(SlurmLauncherTest, OneStepRunsEveryRankWithTheSharedEnvironmentOnly) {
  SlurmLauncher launcher(Options());
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back({{r},
                     {"/bin/sh", "-c", "echo rank=$JAXTRAIN_RANK secret=$SECRET"},
                     {{"SECRET", "s3cr3t"}, {"JAXTRAIN_RANK", std::to_string(r)}},
                     {},
                     dir_});
  }
  auto launched = launcher.Launch(specs);
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  ASSERT_EQ(launched->size(), 1u);
  const LaunchedProcess& step = launched->front();
  EXPECT_EQ(step.ranks, (std::vector<int>{0, 1}));
  std::string output = ReadAll(step.output_fd);
  EXPECT_TRUE(Contains(output, "0: rank=0 secret=s3cr3t\n")) << output;
  EXPECT_TRUE(Contains(output, "1: rank=1 secret=s3cr3t\n")) << output;
  auto exit = [&] {
    pollfd p{step.pidfd, POLLIN, 0};
    poll(&p, 1, 10000);
    return TryReap(step.pid);
  }();
  ASSERT_TRUE(exit.has_value());
  EXPECT_TRUE(exit->ok()) << exit->ToString();
  close(step.pidfd);
  close(step.output_fd);

  std::string args = ReadFile(dir_ + "/srun-args");
  for (const char* arg : {"--jobid=42", "--job-name=jaxtrain-test-1", "--ntasks=2",
                          "--kill-on-bad-exit=1", "--label", "--export=ALL"}) {
    EXPECT_TRUE(Contains(args, std::string(arg) + "\n")) << args;
  }
  EXPECT_TRUE(Contains(args, "--chdir=" + dir_ + "\n")) << args;
  EXPECT_FALSE(Contains(args, "s3cr3t")) << "the environment never goes on a command line";
}

// A task that tells how it was started: standby or fresh, the secret, the attempt. A standby reads
// its activation from stdin (JAXTRAIN_RUN_SECRET_FD=0) as python/jaxtrain/worker.py does.
constexpr char kTellingTask[] =
    "import json, os\n"
    "standby = os.environ.get('JAXTRAIN_STANDBY') == '1'\n"
    "fd = int(os.environ['JAXTRAIN_RUN_SECRET_FD'])\n"
    "pre = 'file ' + os.environ.get('JAXTRAIN_PRELOAD_FILE', 'none')\n"
    "if os.environ.get('JAXTRAIN_PRELOAD_ON_PIPE') == '1':\n"
    "    pre = os.read(fd, int.from_bytes(os.read(fd, 8), 'big')).decode()\n"
    "data = b''\n"
    "while chunk := os.read(fd, 65536):\n"
    "    data += chunk\n"
    "if standby and not data:\n"
    "    raise SystemExit(0)\n"
    "a = json.loads(data) if standby else {'secret': data.decode(), 'env': {}}\n"
    "os.environ.update(a['env'])\n"
    "print('rank', os.environ['JAXTRAIN_RANK'], a['secret'], os.environ.get('JAXTRAIN_ATTEMPT'),\n"
    "      'standby' if standby else 'fresh', 'preload=' + pre, flush=True)\n";

std::vector<ProcessSpec> TellingSpecs(const std::string& dir, int attempt,
                                      const std::string& secret, const std::string& shape = "a",
                                      const std::string& preload_file = "") {
  std::vector<ProcessSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back({{r},
                     {"/usr/bin/python3", "-c", kTellingTask},
                     {{"JAXTRAIN_RANK", std::to_string(r)},
                      {"JAXTRAIN_ATTEMPT", std::to_string(attempt)},
                      {"SHAPE", shape}},
                     {},
                     dir});
    if (!preload_file.empty()) specs.back().env["JAXTRAIN_PRELOAD_FILE"] = preload_file;
    specs.back().secret = secret;
  }
  return specs;
}

// Runs the step to its end: its output.
std::string RunStep(const LaunchedProcess& step) {
  std::string output = ReadAll(step.output_fd);
  pollfd p{step.pidfd, POLLIN, 0};
  poll(&p, 1, 10000);
  auto exit = TryReap(step.pid);
  EXPECT_TRUE(exit.has_value() && exit->ok()) << output;
  close(step.pidfd);
  close(step.output_fd);
  return output;
}

std::string Joined(const std::vector<std::string>& notes) {
  std::string all;
  for (const auto& n : notes) all += n + "\n";
  return all;
}

TEST_F(SlurmLauncherTest, ARestartActivatesTheStandbyStepWithTheNewSecret) {
  SlurmLauncherOptions options = Options();
  options.warm = true;
  SlurmLauncher launcher(options);
  auto first = launcher.Launch(TellingSpecs(dir_, 0, "s0"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(Contains(RunStep(first->front()), "1: rank 1 s0 0 fresh"))
      << ReadFile(dir_ + "/srun-args");

  ASSERT_TRUE(launcher.PrepareNext(TellingSpecs(dir_, 0, "s0")).ok());
  // The fake srun writes its arguments once it runs.
  std::string standby_args;
  for (int i = 0; i < 100 && !Contains(standby_args = ReadFile(dir_ + "/srun-args"), "--overlap");
       ++i) {
    usleep(100 * 1000);
  }
  EXPECT_TRUE(Contains(standby_args, "--overlap\n")) << standby_args;
  EXPECT_TRUE(Contains(standby_args, "--job-name=jaxtrain-test-2\n")) << standby_args;
  EXPECT_TRUE(Contains(standby_args, "--input=all\n")) << standby_args;

  auto restart = launcher.Launch(TellingSpecs(dir_, 1, "s1"));
  ASSERT_TRUE(restart.ok()) << restart.status().ToString();
  // No new srun: the standby step is the attempt's.
  EXPECT_EQ(ReadFile(dir_ + "/srun-args"), standby_args);
  const std::string output = RunStep(restart->front());
  EXPECT_TRUE(Contains(output, "0: rank 0 s1 1 standby")) << output;
  EXPECT_TRUE(Contains(output, "1: rank 1 s1 1 standby")) << output;
  EXPECT_TRUE(Contains(Joined(launcher.TakeDetails()),
                       "ranks 0,1 started from a standby step (jaxtrain-test-2"));
}

TEST_F(SlurmLauncherTest, AStandbyStepOfAnotherPlacementIsEndedAndANewStepStarted) {
  SlurmLauncherOptions options = Options();
  options.warm = true;
  SlurmLauncher launcher(options);
  ASSERT_TRUE(launcher.PrepareNext(TellingSpecs(dir_, 0, "s0", "a")).ok());
  auto launched = launcher.Launch(TellingSpecs(dir_, 1, "s1", "b"));
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const std::string output = RunStep(launched->front());
  EXPECT_TRUE(Contains(output, "0: rank 0 s1 1 fresh")) << output;
  EXPECT_TRUE(Contains(Joined(launcher.TakeNotes()),
                       "the standby step jaxtrain-test-1 was started for another placement; "
                       "starting a new step"));
  EXPECT_TRUE(Contains(ReadFile(dir_ + "/srun-args"), "--job-name=jaxtrain-test-2\n"));
}

TEST_F(SlurmLauncherTest, TheStandbyStepGetsThePickledFunctionOnItsStdinFirst) {
  SlurmLauncherOptions options = Options();
  options.warm = true;
  SlurmLauncher launcher(options);
  const std::string file = dir_ + "/task.pkl";
  std::ofstream(file) << "pickled bytes";
  ASSERT_TRUE(launcher.PrepareNext(TellingSpecs(dir_, 0, "s0", "a", file)).ok());
  auto launched = launcher.Launch(TellingSpecs(dir_, 1, "s1", "a", file));
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  const std::string output = RunStep(launched->front());
  EXPECT_TRUE(Contains(output, "0: rank 0 s1 1 standby preload=pickled bytes")) << output;
  EXPECT_TRUE(Contains(output, "1: rank 1 s1 1 standby preload=pickled bytes")) << output;
  // A step started afresh gets neither the bytes nor the driver's path.
  auto fresh = launcher.Launch(TellingSpecs(dir_, 2, "s2", "a", file));
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_TRUE(Contains(RunStep(fresh->front()), "0: rank 0 s2 2 fresh preload=file none"));
}

TEST_F(SlurmLauncherTest, EndRunEndsTheStandbyStepItsTasksReadingEof) {
  SlurmLauncherOptions options = Options();
  options.warm = true;
  SlurmLauncher launcher(options);
  ASSERT_TRUE(launcher.PrepareNext(TellingSpecs(dir_, 0, "s0")).ok());
  launcher.EndRun(false);
  // Ended by its tasks' EOF, not by scancel.
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/scancel-args"));
}

TEST_F(SlurmLauncherTest, OneRanksOutputIsNotLabelled) {
  SlurmLauncherOptions options = Options();
  options.shape.tasks = 1;
  SlurmLauncher launcher(options);
  auto launched = launcher.Launch({{{0}, {"/bin/echo", "hello"}, {}, {}, ""}});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  EXPECT_EQ(ReadAll(launched->front().output_fd), "hello\n");
  EXPECT_FALSE(Contains(ReadFile(dir_ + "/srun-args"), "--label"));
  pollfd p{launched->front().pidfd, POLLIN, 0};
  poll(&p, 1, 10000);
  EXPECT_TRUE(TryReap(launched->front().pid)->ok());
  close(launched->front().pidfd);
  close(launched->front().output_fd);
}

TEST_F(SlurmLauncherTest, RefusesRanksWhoseEnvironmentsDifferBeyondTheirPlace) {
  SlurmLauncher launcher(Options());
  std::vector<ProcessSpec> specs = {{{0}, {"/bin/true"}, {{"CUDA_VISIBLE_DEVICES", "0"}}, {}, ""},
                                    {{1}, {"/bin/true"}, {{"CUDA_VISIBLE_DEVICES", "1"}}, {}, ""}};
  auto launched = launcher.Launch(specs);
  EXPECT_EQ(launched.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(launched.status().message(), "CUDA_VISIBLE_DEVICES differs"));
}

TEST_F(SlurmLauncherTest, NoStepInAnAllocationThatSlurmHasEnded) {
  SlurmLauncher launcher(Options("COMPLETING NodeDown"));
  auto launched = launcher.Launch({{{0}, {"/bin/true"}, {}, {}, ""}});
  EXPECT_EQ(launched.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(launched.status().message(), "Slurm job 42"));
  EXPECT_TRUE(Contains(launched.status().message(), "COMPLETING NodeDown"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/srun-args")) << "srun was started";
}

TEST_F(SlurmLauncherTest, ARetryNearTheTimeLimitOfItsOwnAllocationGoesToANewOne) {
  SlurmLauncherOptions options = Options();
  options.shape = {.tasks = 1, .signal_s = 90};
  // Slurm's client as Request() finds it on PATH: salloc grants jobs 7, 8, ...; squeue says each
  // runs, with the time left in $dir/left.
  Script("salloc", "#!/bin/sh\nn=$(( $(cat " + dir_ + "/jobs 2>/dev/null || echo 6) + 1 ))\n" +
                       "echo $n > " + dir_ + "/jobs\necho \"salloc: Granted job allocation $n\"\n");
  Script("squeue",
         "#!/bin/sh\ncase \"$*\" in *%L*) cat " + dir_ + "/left;; *) echo 'RUNNING None';; esac\n");
  std::ofstream(dir_ + "/left") << "1:30\n";  // 90 s: the notice is due (<= 90 + 60)
  const std::string path = getenv("PATH");
  setenv("PATH", (dir_ + ":" + path).c_str(), 1);
  auto allocation = SlurmAllocation::Request(options.shape, "jaxtrain-test", [] { return false; });
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  options.job_id = (*allocation)->job_id();
  EXPECT_EQ(options.job_id, "7");
  {
    SlurmLauncher launcher(options, std::move(*allocation));
    auto launch = [&]() -> std::string {
      auto launched = launcher.Launch({{{0}, {"/bin/true"}, {}, {}, ""}});
      if (!launched.ok()) return launched.status().ToString();
      pollfd p{launched->front().pidfd, POLLIN, 0};
      poll(&p, 1, 10000);
      EXPECT_TRUE(TryReap(launched->front().pid)->ok());
      close(launched->front().pidfd);
      close(launched->front().output_fd);
      return ReadFile(dir_ + "/srun-args");
    };
    // The first step runs in the allocation it was given, however near its limit.
    EXPECT_TRUE(Contains(launch(), "--jobid=7\n"));
    // A retry: job 7 is released and the same request made again.
    EXPECT_TRUE(Contains(launch(), "--jobid=8\n"));
    EXPECT_TRUE(Contains(ReadFile(dir_ + "/scancel-args"), "--quiet 7\n"));
    // With time to spare, or none set, a retry stays where it is.
    for (const char* left : {"2:31\n", "UNLIMITED\n"}) {
      std::ofstream(dir_ + "/left") << left;
      EXPECT_TRUE(Contains(launch(), "--jobid=8\n")) << left;
    }
  }
  EXPECT_TRUE(Contains(ReadFile(dir_ + "/scancel-args"), "--quiet 8\n"));  // released at the end
  setenv("PATH", path.c_str(), 1);
}

TEST_F(SlurmLauncherTest, AStepThatCannotBeCancelledIsANoteTakenNotWritten) {
  SlurmLauncherOptions options = Options();
  // squeue answers the state check, then lists the steps ($dir/steps) or fails.
  options.squeue = Script("squeue", "#!/bin/sh\ncase \"$*\" in *--steps*) cat " + dir_ +
                                        "/steps || exit 1;; *) echo 'RUNNING None';; esac\n");
  options.scancel = Script("scancel", "#!/bin/sh\necho 'no such step' >&2\nexit 1\n");
  SlurmLauncher launcher(options);
  auto launched = launcher.Launch({{{0}, {"/bin/true"}, {}, {}, ""}});
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  pollfd p{launched->front().pidfd, POLLIN, 0};
  poll(&p, 1, 10000);
  EXPECT_TRUE(TryReap(launched->front().pid)->ok());
  close(launched->front().pidfd);
  close(launched->front().output_fd);

  // What SignalGroup() writes on stderr while the loop runs it: nothing.
  const std::string stderr_path = dir_ + "/stderr";
  auto kill_step = [&] {
    fflush(stderr);
    const int saved = dup(2);
    const int file = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    dup2(file, 2);
    close(file);
    Status s = launcher.SignalGroup(SIGKILL);
    dup2(saved, 2);
    close(saved);
    return s;
  };
  EXPECT_TRUE(kill_step().ok());  // squeue fails: the step cannot be found
  EXPECT_EQ(ReadFile(stderr_path), "");
  Strings notes = launcher.TakeNotes();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_TRUE(Contains(notes[0], "cannot find the job step to cancel: ")) << notes[0];
  EXPECT_TRUE(launcher.TakeNotes().empty()) << "a note is taken once";

  std::ofstream(dir_ + "/steps") << "42.0|jaxtrain-test-1\n42.1|another-step\n";
  EXPECT_TRUE(kill_step().ok());  // scancel fails
  EXPECT_EQ(ReadFile(stderr_path), "");
  notes = launcher.TakeNotes();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_TRUE(Contains(notes[0], "cannot cancel job step 42.0: ")) << notes[0];
}

TEST_F(SlurmLauncherTest, ASlurmCommandThatHangsIsKilledAndNamed) {
  SlurmLauncherOptions options = Options();
  options.squeue = Script("squeue", "#!/bin/sh\nexec sleep 60\n");
  options.command_timeout = std::chrono::milliseconds(300);
  SlurmLauncher launcher(options);
  auto start = std::chrono::steady_clock::now();
  auto launched = launcher.Launch({{{0}, {"/bin/true"}, {}, {}, ""}});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(launched.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(launched.status().message(), "did not finish within 0.3 s and was killed"))
      << launched.status().ToString();
  EXPECT_TRUE(Contains(launched.status().message(), "squeue --noheader --jobs=42"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/srun-args")) << "srun was started";
}

// The controller with the Slurm launcher: one process for all ranks, its output split by label.
class ControllerOnSlurmTest : public SlurmLauncherTest {
 protected:
  controller::ControllerOptions ControllerOptions(int workers, Strings args) {
    accelerators::FakeHost host;
    controller::ControllerOptions o;
    o.run_dir = dir_ + "/run";
    o.experiment_name = "slurm_test";
    o.plan = *PlanForSlurm(Config({.num_workers = workers}), host);
    o.worker_argv = {FAKE_WORKER_PATH};
    o.worker_argv.insert(o.worker_argv.end(), args.begin(), args.end());
    console_path_ = dir_ + "/console";
    console_fd_ = open(console_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    o.console_fd = console_fd_;
    o.terminate_grace = std::chrono::seconds(2);
    return o;
  }
  void TearDown() override {
    if (console_fd_ >= 0) close(console_fd_);
    SlurmLauncherTest::TearDown();
  }
  std::string Log(int rank) {
    return ReadFile(dir_ + "/run/logs/rank-" + std::to_string(rank) + ".log");
  }

  std::string console_path_;
  int console_fd_ = -1;
};

TEST_F(ControllerOnSlurmTest, EveryRankRunsInOneStepAndGetsItsOwnLog) {
  controller::ControllerOptions o = ControllerOptions(3, {"ok", "2"});
  SlurmLauncherOptions lo = Options();
  lo.shape.tasks = 3;
  controller::Controller c(std::move(o), std::make_unique<SlurmLauncher>(lo));
  ASSERT_TRUE(c.Start().ok());
  ASSERT_TRUE(c.Wait(std::chrono::seconds(30)));
  EXPECT_EQ(c.outcome().state, controller::Outcome::State::kSucceeded)
      << (c.outcome().failure ? c.outcome().failure->message : "");
  EXPECT_EQ(c.outcome().rounds, 2u);
  for (int r = 0; r < 3; ++r) {
    std::string log = Log(r);
    EXPECT_TRUE(Contains(log, "fake_worker rank=" + std::to_string(r) + " pid=")) << log;
    EXPECT_FALSE(Contains(log, "fake_worker rank=" + std::to_string((r + 1) % 3))) << log;
    EXPECT_FALSE(Contains(log, std::to_string(r) + ": ")) << "the label is not in the log";
  }
  std::string console = ReadFile(console_path_);
  EXPECT_TRUE(Contains(console, "(rank=2) fake_worker rank=2 pid=")) << console;
}

TEST_F(ControllerOnSlurmTest, ATaskKilledIsBlamedAsSrunReportsItAndTheGroupRestarts) {
  controller::ControllerOptions o = ControllerOptions(2, {"crash"});
  o.worker_env["FAKE_FAIL_RANK"] = "1";
  o.max_failures = 1;
  controller::Controller c(std::move(o), std::make_unique<SlurmLauncher>(Options()));
  ASSERT_TRUE(c.Start().ok());
  ASSERT_TRUE(c.Wait(std::chrono::seconds(30)));
  const controller::Outcome& out = c.outcome();
  EXPECT_EQ(out.state, controller::Outcome::State::kFailed);
  EXPECT_EQ(out.attempts, 2);
  ASSERT_EQ(out.failures.size(), 2u);
  for (const auto& f : out.failures) {
    EXPECT_EQ(f.rank, 1);
    EXPECT_EQ(f.cause, controller::FailureCause::kSignal);
    EXPECT_EQ(f.message, "its process was killed by signal 9 (SIGKILL) on fakehost");
  }
  std::string log = Log(1);
  EXPECT_TRUE(Contains(log, "srun: error: fakehost: task 1: Killed")) << log;
  EXPECT_FALSE(Contains(Log(0), "task 1: Killed")) << "srun's line goes to the rank it names";
}

// srun turns the controller's SIGTERM into SIGKILL for every task, and may report those kills
// before the one that caused the stop: a rank still connected when the stop began was killed by
// it, and the rank whose process ended first is blamed whatever srun's order.
TEST_F(ControllerOnSlurmTest, ATaskKilledIsBlamedWhenSrunReportsTheKillItCausedFirst) {
  controller::ControllerOptions o = ControllerOptions(2, {"crash"});
  o.worker_env["FAKE_FAIL_RANK"] = "1";
  setenv("FAKE_SRUN_REMOTE", "1", 1);
  controller::Controller c(std::move(o), std::make_unique<SlurmLauncher>(Options()));
  ASSERT_TRUE(c.Start().ok());
  ASSERT_TRUE(c.Wait(std::chrono::seconds(30)));
  unsetenv("FAKE_SRUN_REMOTE");
  const controller::Outcome& out = c.outcome();
  EXPECT_EQ(out.state, controller::Outcome::State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_EQ(out.failure->message, "its process was killed by signal 9 (SIGKILL) on fakehost");
  std::string console = ReadFile(console_path_);
  ASSERT_NE(console.find("task 1: Killed"), std::string::npos) << console;
  EXPECT_LT(console.find("task 0: Killed"), console.find("task 1: Killed")) << console;
}

TEST_F(SlurmLauncherTest, ANodeDrainedOrDownIsUnreachableAndLeaving) {
  SlurmLauncherOptions options = Options();
  options.scontrol = Script("scontrol", "#!/bin/sh\necho \"$@\" >> " + dir_ +
                                            "/scontrol-args\nexec cat " + dir_ + "/nodes\n");
  SlurmLauncher launcher(options);
  std::ofstream(dir_ + "/nodes") << "NodeName=node1 State=ALLOCATED Reason=\n"
                                    "NodeName=node2 State=MIXED+DRAIN Reason=test [root@now]\n"
                                    "NodeName=node3 State=DOWN+NOT_RESPONDING\n";
  const Strings all = {"node1", "node2", "node3"};
  EXPECT_EQ(*launcher.UnreachableHosts(all, Duration::zero(), -1), (Strings{"node2", "node3"}));
  EXPECT_EQ(*launcher.LeavingHosts({"node1", "node2"}, -1), (Strings{"node2"}));
  EXPECT_EQ(ReadFile(dir_ + "/scontrol-args"),
            "--oneliner show node node1,node2,node3\n--oneliner show node node1,node2\n");
  // Slurm cannot say: no node is taken as usable, and none as leaving.
  std::filesystem::remove(dir_ + "/nodes");
  EXPECT_EQ(*launcher.UnreachableHosts(all, Duration::zero(), -1), all);
  EXPECT_TRUE(launcher.LeavingHosts(all, -1)->empty());
  // A wait ends once the node is resumed.
  std::ofstream(dir_ + "/nodes") << "NodeName=node1 State=IDLE\nNodeName=node2 State=IDLE+DRAIN\n";
  std::thread resume([&] {
    usleep(300 * 1000);
    std::ofstream(dir_ + "/nodes.new") << "NodeName=node1 State=IDLE\nNodeName=node2 State=IDLE\n";
    std::filesystem::rename(dir_ + "/nodes.new", dir_ + "/nodes");
  });
  auto down = launcher.UnreachableHosts({"node1", "node2"}, std::chrono::seconds(60), -1);
  resume.join();
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  EXPECT_TRUE(down->empty());
  launcher.Interrupt();
  EXPECT_EQ(launcher.UnreachableHosts(all, Duration::zero(), -1).status().code(),
            StatusCode::kCancelled);
}

TEST_F(SlurmLauncherTest, AfterUsePlanTheStepsRunOnThePlansNodes) {
  SlurmLauncherOptions options = Options();
  options.shape = {.tasks = 4, .spread = true};
  options.warm = true;
  SlurmLauncher launcher(options);
  placement::Plan plan;
  for (int r = 0; r < 2; ++r) plan.workers.push_back({.rank = r, .host = "node1"});
  // A standby step started for the run's 4 ranks is not the shrunk attempt's: it is ended.
  ASSERT_TRUE(launcher.PrepareNext(TellingSpecs(dir_, 0, "s0")).ok());
  ASSERT_TRUE(launcher.UsePlan(plan).ok());
  auto launched = launcher.Launch(TellingSpecs(dir_, 1, "s1"));
  ASSERT_TRUE(launched.ok()) << launched.status().ToString();
  EXPECT_TRUE(Contains(RunStep(launched->front()), "1: rank 1 s1 1 fresh"));
  EXPECT_TRUE(Contains(Joined(launcher.TakeNotes()),
                       "the standby step jaxtrain-test-1 was started for another placement"));
  const std::string args = ReadFile(dir_ + "/srun-args");
  for (const char* arg : {"--ntasks=2", "--nodes=1", "--ntasks-per-node=2", "--nodelist=node1"}) {
    EXPECT_TRUE(Contains(args, std::string(arg) + "\n")) << args;
  }
  EXPECT_FALSE(Contains(args, "--distribution")) << "ranks in blocks, as the plan numbers them";

  placement::Plan uneven = plan;
  uneven.workers.push_back({.rank = 2, .host = "node2"});
  EXPECT_EQ(launcher.UsePlan(uneven).message(),
            "the plan puts 1 rank(s) on Slurm node node2 and 2 on node1; a step runs the same "
            "number on each node");
}

}  // namespace
}  // namespace jaxtrain::launch
