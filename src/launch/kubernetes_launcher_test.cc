#include "launch/kubernetes_launcher.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace jaxtrain::launch {
namespace {

using nlohmann::json;

config::ScalingConfig Config(config::ScalingConfigInput input) {
  auto c = config::ScalingConfig::Create(std::move(input));
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

KubernetesOptions Options() {
  auto o = KubernetesOptions::FromJson({{"namespace", "ml"},
                                        {"name", "run-abcde"},
                                        {"image", "example/train:1"},
                                        {"request_dir", "/tmp/unused"},
                                        {"worker_command", {"python", "-m", "jaxtrain.worker"}},
                                        {"supervisor_argv", {"python", "-m", "sup"}}});
  EXPECT_TRUE(o.ok()) << o.status().message();
  return *o;
}

KubernetesOptions Queued(const std::string& queue, const std::string& priority) {
  auto o = KubernetesOptions::FromJson({{"namespace", "ml"},
                                        {"name", "run-abcde"},
                                        {"image", "example/train:1"},
                                        {"request_dir", "/tmp/unused"},
                                        {"worker_command", {"python"}},
                                        {"supervisor_argv", {"python"}},
                                        {"queue_name", queue},
                                        {"priority_class", priority}});
  EXPECT_TRUE(o.ok()) << o.status().message();
  return *o;
}

StatusOr<json> Manifest(const config::ScalingConfig& c, const KubernetesOptions& o,
                        bool simulate = false) {
  accelerators::FakeHost host;
  if (simulate) host.env["JAXTRAIN_SIMULATE"] = "1";
  auto plan = PlanForKubernetes(c, host);
  if (!plan.ok()) return plan.status();
  return JobSetManifest(c, *plan, o, "run-abcde-1", {{"JAXTRAIN_WORLD_SIZE", "4"}});
}

const json& Pod(const json& jobset) {
  return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"];
}

std::optional<json> Env(const json& pod, const std::string& name) {
  for (const auto& e : pod["spec"]["containers"][0]["env"]) {
    if (e["name"] == name) return e;
  }
  return std::nullopt;
}

TEST(JobSetManifestTest, CpuWorkersAreOneIndexedJobOfPlainPods) {
  auto m = Manifest(Config({.num_workers = 4}), Options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ((*m)["kind"], "JobSet");
  EXPECT_EQ((*m)["metadata"]["name"], "run-abcde-1");
  EXPECT_EQ((*m)["metadata"]["namespace"], "ml");
  EXPECT_EQ((*m)["spec"]["failurePolicy"]["maxRestarts"], 0);
  const json& job = (*m)["spec"]["replicatedJobs"][0];
  EXPECT_EQ(job["replicas"], 1);
  EXPECT_EQ(job["template"]["spec"]["parallelism"], 4);
  EXPECT_EQ(job["template"]["spec"]["completionMode"], "Indexed");
  EXPECT_EQ(job["template"]["spec"]["backoffLimit"], 0);
  const json& pod = Pod(*m);
  EXPECT_EQ(pod["spec"]["restartPolicy"], "Never");
  EXPECT_FALSE(pod["spec"].contains("nodeSelector"));
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["image"], "example/train:1");
  EXPECT_EQ(c["command"], json({"python", "-m", "jaxtrain.worker"}));
  EXPECT_FALSE(c.contains("resources"));
  EXPECT_EQ(Env(pod, "JAXTRAIN_WORLD_SIZE").value()["value"], "4");
  EXPECT_EQ(Env(pod, "JAXTRAIN_K8S_PODS_PER_JOB").value()["value"], "4");
  EXPECT_EQ(Env(pod, "JAXTRAIN_RUN_SECRET_FILE").value()["value"], "/var/run/jaxtrain/secret");
  EXPECT_EQ(pod["spec"]["volumes"][0]["secret"]["secretName"], "run-abcde-1");
}

TEST(JobSetManifestTest, TpuSlicesFollowGkesContract) {
  // v4 2x2x2: 8 chips, 2 hosts of 4; 4 workers = 2 slices.
  auto c = Config(
      {.num_workers = 4, .use_tpu = true, .topology = "2x2x2", .accelerator_type = "TPU-V4"});
  auto m = Manifest(c, Options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ((*m)["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"],
            "cloud.google.com/gke-nodepool");
  const json& job = (*m)["spec"]["replicatedJobs"][0];
  EXPECT_EQ(job["name"], "slice");
  EXPECT_EQ(job["replicas"], 2);
  EXPECT_EQ(job["template"]["spec"]["parallelism"], 2);
  const json& pod = Pod(*m);
  EXPECT_EQ(pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"], "tpu-v4-podslice");
  EXPECT_EQ(pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"], "2x2x2");
  EXPECT_EQ(pod["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"], "4");
  EXPECT_EQ(Env(pod, "MEGASCALE_NUM_SLICES").value()["value"], "2");
  EXPECT_EQ(Env(pod, "MEGASCALE_COORDINATOR_ADDRESS").value()["value"],
            "run-abcde-1-slice-0-0.run-abcde-1");
  EXPECT_EQ(Env(pod, "MEGASCALE_SLICE_ID").value()["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.labels['jobset.sigs.k8s.io/job-index']");
}

TEST(JobSetManifestTest, SimulatedTpuKeepsThePodSpecButNoMegascale) {
  auto c = Config(
      {.num_workers = 4, .use_tpu = true, .topology = "2x4", .accelerator_type = "v5litepod"});
  auto m = Manifest(c, Options(), /*simulate=*/true);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const json& pod = Pod(*m);
  EXPECT_EQ(pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"],
            "tpu-v5-lite-podslice");
  EXPECT_EQ(pod["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"], "8");
  EXPECT_FALSE(Env(pod, "MEGASCALE_NUM_SLICES").has_value());
  EXPECT_EQ(Env(pod, "JAXTRAIN_WORLD_SIZE").value()["value"], "4");
}

TEST(JobSetManifestTest, GpusAreWholeNvidiaLimits) {
  auto m = Manifest(
      Config({.num_workers = 2, .use_gpu = true, .resources_per_worker = {{"GPU", 2}, {"CPU", 8}}}),
      Options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  const json& r = Pod(*m)["spec"]["containers"][0]["resources"];
  EXPECT_EQ(r["limits"]["nvidia.com/gpu"], "2");
  EXPECT_EQ(r["requests"]["cpu"], "8");
}

TEST(JobSetManifestTest, RefusesWhatGkeOrOnePodPerWorkerCannotGive) {
  auto v3 = Manifest(
      Config({.num_workers = 4, .use_tpu = true, .topology = "4x4", .accelerator_type = "TPU-V3"}),
      Options());
  EXPECT_EQ(v3.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v3.status().message().find("not offered on GKE"), std::string::npos);

  auto split = Manifest(Config({.num_workers = 8,
                                .use_tpu = true,
                                .topology = "2x2x2",
                                .accelerator_type = "TPU-V4",
                                .resources_per_worker = {{"TPU", 2}}}),
                        Options());
  EXPECT_EQ(split.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("one worker runs per TPU VM host"), std::string::npos);

  auto half =
      Manifest(Config({.num_workers = 2, .use_gpu = true, .resources_per_worker = {{"GPU", 0.5}}}),
               Options());
  EXPECT_EQ(half.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(half.status().message().find("nvidia.com/gpu"), std::string::npos);
}

TEST(JobSetManifestTest, ThePodTemplateIsKeptUnderWhatJaxtrainDecides) {
  KubernetesOptions o = Options();
  o.pod_template = json::parse(R"({
    "metadata": {"labels": {"team": "ml"}},
    "spec": {"tolerations": [{"key": "tpu", "operator": "Exists"}],
             "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "runs"}}],
             "containers": [{"name": "trainer", "command": ["ignored"],
                             "env": [{"name": "A", "value": "1"},
                                     {"name": "JAXTRAIN_WORLD_SIZE", "value": "99"}],
                             "volumeMounts": [{"name": "data", "mountPath": "/runs"}]}]}})");
  auto m = Manifest(Config({.num_workers = 4}), o);
  ASSERT_TRUE(m.ok()) << m.status().message();
  const json& pod = Pod(*m);
  EXPECT_EQ(pod["metadata"]["labels"]["team"], "ml");
  EXPECT_EQ(pod["metadata"]["labels"]["app.kubernetes.io/managed-by"], "jaxtrain");
  EXPECT_EQ(pod["spec"]["tolerations"][0]["key"], "tpu");
  EXPECT_EQ(pod["spec"]["volumes"].size(), 2u);
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["name"], "trainer");
  EXPECT_EQ(c["command"][0], "python");
  EXPECT_EQ(Env(pod, "A").value()["value"], "1");
  EXPECT_EQ(Env(pod, "JAXTRAIN_WORLD_SIZE").value()["value"], "4");
  EXPECT_EQ(c["volumeMounts"].size(), 2u);

  o.pod_template = json::array();
  EXPECT_EQ(KubernetesOptions::FromJson({{"namespace", "ml"},
                                         {"name", "r"},
                                         {"image", "i"},
                                         {"request_dir", "/tmp"},
                                         {"worker_command", {"python"}},
                                         {"supervisor_argv", {"python"}},
                                         {"pod_template", json::array()}})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(JobSetManifestTest, TheUsersVariablesAreReadFromTheSecretNotThePodSpec) {
  auto c = Config({.num_workers = 2});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok());
  const std::map<std::string, std::string> env = {{"JAXTRAIN_WORLD_SIZE", "2"},
                                                  {"WANDB_API_KEY", "hunter2-key"}};
  auto m = JobSetManifest(c, *plan, Options(), "run-abcde-1", env);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->dump().find("hunter2-key"), std::string::npos);
  const json& pod = Pod(*m);
  EXPECT_EQ(Env(pod, "JAXTRAIN_WORLD_SIZE").value()["value"], "2");
  EXPECT_EQ(Env(pod, "WANDB_API_KEY").value()["valueFrom"]["secretKeyRef"],
            json({{"name", "run-abcde-1"}, {"key", "env.WANDB_API_KEY"}}));
  EXPECT_EQ(SecretEnv(env),
            (std::map<std::string, std::string>{{"env.WANDB_API_KEY", "hunter2-key"}}));

  auto odd = JobSetManifest(c, *plan, Options(), "run-abcde-1", {{"A:B", "1"}});
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(odd.status().message().find("'A:B'"), std::string::npos);
}

// The specs the controller gives the launcher for `plan`: one process per rank, with what the
// plan sets for that rank.
std::vector<ProcessSpec> SpecsFor(const placement::Plan& plan) {
  std::vector<ProcessSpec> specs;
  for (const placement::WorkerPlacement& w : plan.workers) {
    ProcessSpec spec{.ranks = {w.rank},
                     .argv = {"/usr/bin/python3", "-m", "jaxtrain.worker"},
                     .env = w.env,
                     .unset_env = w.unset_env,
                     .secret = "the-run-key"};
    spec.env["JAXTRAIN_RANK"] = std::to_string(w.rank);
    spec.env["JAXTRAIN_WORLD_SIZE"] = std::to_string(plan.workers.size());
    specs.push_back(std::move(spec));
  }
  return specs;
}

// What the worker of `rank` has in its pod once it knows its rank: the container's variables
// (those in the Secret read from it), then its own entry of JAXTRAIN_RANK_ENV
// (python/jaxtrain/worker.py, _take_rank_env).
std::map<std::string, std::string> WorkerEnvInPod(const json& request, int rank) {
  std::map<std::string, std::string> env;
  for (const auto& e : Pod(request["jobset"])["spec"]["containers"][0]["env"]) {
    if (e.contains("value")) {
      env[e["name"]] = e["value"];
    } else if (e["valueFrom"].contains("secretKeyRef")) {
      env[e["name"]] = request["secret"]["env"].at(e["valueFrom"]["secretKeyRef"]["key"]);
    }
  }
  if (auto table = env.find("JAXTRAIN_RANK_ENV"); table != env.end()) {
    const json own = json::parse(table->second).value(std::to_string(rank), json::object());
    env.erase(table);
    for (const auto& [name, value] : own.items()) env[name] = value;
  }
  return env;
}

TEST(JobSetRequestTest, ASimulatedTpuPodGetsTheEnvironmentOfALocalSimulatedWorker) {
  accelerators::FakeHost host;
  host.env["JAXTRAIN_SIMULATE"] = "1";
  const std::vector<config::ScalingConfigInput> inputs = {
      {.num_workers = 4, .use_tpu = true, .topology = "4x4", .accelerator_type = "TPU-V6E"},
      {.num_workers = 8, .use_tpu = true, .topology = "4x4", .accelerator_type = "TPU-V6E"}};
  for (const auto& in : inputs) {  // one slice, then two
    const config::ScalingConfig c = Config(in);
    auto local = placement::PlanLocal(c, host);
    auto plan = PlanForKubernetes(c, host);
    ASSERT_TRUE(local.ok()) << local.status().message();
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    auto request = JobSetRequest(c, *plan, Options(), "run-abcde-1", SpecsFor(*plan));
    ASSERT_TRUE(request.ok()) << request.status().message();
    EXPECT_EQ((*request)["ranks"], in.num_workers);
    EXPECT_EQ((*request)["secret"]["key"], "the-run-key");
    for (int rank = 0; rank < in.num_workers; ++rank) {
      const std::map<std::string, std::string> seen = WorkerEnvInPod(*request, rank);
      for (const auto& [name, value] : local->workers[rank].env) {
        auto it = seen.find(name);
        ASSERT_NE(it, seen.end()) << name << " of rank " << rank;
        EXPECT_EQ(it->second, value) << name << " of rank " << rank;
      }
      EXPECT_EQ(seen.at("TPU_WORKER_ID"), std::to_string(rank % 4));
      EXPECT_EQ(seen.at("TPU_WORKER_HOSTNAMES").find("sim-slice-" + std::to_string(rank / 4)), 0u);
      EXPECT_EQ(seen.at("TPU_ACCELERATOR_TYPE"), "v6e-16");
      EXPECT_EQ(seen.at("TPU_TOPOLOGY"), "4x4");
    }
  }
}

TEST(JobSetRequestTest, ARealTpuPodKeepsWhatGkeSetsInIt) {
  const config::ScalingConfig c =
      Config({.num_workers = 4, .use_tpu = true, .topology = "4x4", .accelerator_type = "TPU-V6E"});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  auto request = JobSetRequest(c, *plan, Options(), "run-abcde-1", SpecsFor(*plan));
  ASSERT_TRUE(request.ok()) << request.status().message();
  const json& pod = Pod((*request)["jobset"]);
  for (const char* name : {"TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
                           "TPU_TOPOLOGY", "JAXTRAIN_RANK_ENV"}) {
    EXPECT_FALSE(Env(pod, name).has_value()) << name;
  }
  EXPECT_EQ(WorkerEnvInPod(*request, 2).at("JAX_PLATFORMS"), "tpu");
}

TEST(JobSetRequestTest, SpecsWithoutTheRunKeyAreRefused) {
  const config::ScalingConfig c = Config({.num_workers = 2});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  std::vector<ProcessSpec> specs = SpecsFor(*plan);
  for (ProcessSpec& spec : specs) spec.secret.clear();
  EXPECT_EQ(JobSetRequest(c, *plan, Options(), "run-abcde-1", specs).status().code(),
            StatusCode::kInternal);
}

TEST(JobSetManifestTest, WorkerPodsGetNoServiceAccountTokenUnlessTheTemplateAsks) {
  auto m = Manifest(Config({.num_workers = 2}), Options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(Pod(*m)["spec"].value("automountServiceAccountToken", json()), json(false));

  KubernetesOptions o = Options();
  o.pod_template = json::parse(R"({"spec": {"automountServiceAccountToken": true}})");
  auto asked = Manifest(Config({.num_workers = 2}), o);
  ASSERT_TRUE(asked.ok()) << asked.status().message();
  EXPECT_EQ(Pod(*asked)["spec"]["automountServiceAccountToken"], true);
}

TEST(JobSetManifestTest, ANonRootWorkerReadsTheKeyThroughFsGroupOrIsRefused) {
  auto mode = [](const char* template_json) -> StatusOr<json> {
    KubernetesOptions o = Options();
    o.pod_template = json::parse(template_json);
    auto m = Manifest(Config({.num_workers = 2}), o);
    if (!m.ok()) return m.status();
    return Pod(*m)["spec"]["volumes"].back()["secret"]["defaultMode"];
  };
  EXPECT_EQ(*mode(R"({"spec": {}})"), 0400);
  EXPECT_EQ(*mode(R"({"spec": {"securityContext": {"runAsUser": 0}}})"), 0400);
  EXPECT_EQ(*mode(R"({"spec": {"securityContext": {"runAsUser": 1000, "fsGroup": 2000}}})"), 0440);
  EXPECT_EQ(*mode(R"({"spec": {"securityContext": {"runAsNonRoot": true, "fsGroup": 2000}}})"),
            0440);

  auto refused = mode(R"({"spec": {"securityContext": {"runAsUser": 1000}}})");
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("spec.securityContext.runAsUser=1000"),
            std::string::npos);
  EXPECT_NE(refused.status().message().find("set spec.securityContext.fsGroup"), std::string::npos);
  auto container =
      mode(R"({"spec": {"containers": [{"securityContext": {"runAsNonRoot": true}}]}})");
  EXPECT_EQ(container.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(container.status().message().find("spec.containers[0].securityContext.runAsNonRoot"),
            std::string::npos);
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") {
      names.push_back(e->d_name);
    }
  }
  closedir(d);
  return names;
}

TEST(KubernetesLauncherTest, LeavesNoRequestBehindWhenItsSupervisorNeverReadIt) {
  char base[] = "/tmp/kubernetes-launcher-test-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  KubernetesOptions o = Options();
  o.request_dir = base;
  o.supervisor_argv = {"true"};  // exits without reading (or deleting) its request
  auto c = Config({.num_workers = 2});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok());
  {
    KubernetesLauncher launcher(o, c, *plan);
    std::vector<ProcessSpec> specs = {{{0}, {"python"}, {}, {}, "", "ab"},
                                      {{1}, {"python"}, {}, {}, "", "ab"}};
    for (int attempt = 1; attempt <= 2; ++attempt) {
      auto launched = launcher.Launch(specs);
      ASSERT_TRUE(launched.ok()) << launched.status().message();
      int status = 0;
      waitpid((*launched)[0].pid, &status, 0);
      close((*launched)[0].pidfd);
      close((*launched)[0].output_fd);
      const std::vector<std::string> dirs = Entries(base);
      ASSERT_EQ(dirs.size(), 1u);
      // Only this attempt's request: the earlier one, never read, went at this Launch().
      EXPECT_EQ(Entries(std::string(base) + "/" + dirs[0]),
                std::vector<std::string>{"run-abcde-" + std::to_string(attempt) + ".json"});
    }
    launcher.EndRun(/*keep=*/true);
    EXPECT_TRUE(Entries(base).empty());
  }
  EXPECT_TRUE(Entries(base).empty());
  rmdir(base);
}

TEST(KubernetesLauncherTest, AQueuedLaunchWaitsForAdmissionAndLeavesTheRestToTheController) {
  char base[] = "/tmp/kubernetes-launcher-test-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  KubernetesOptions o = Queued("team", "");
  o.request_dir = base;
  // A supervisor whose JobSet is queued, then admitted, then runs its ranks.
  o.supervisor_argv = {"sh", "-c",
                       "echo 'jaxtrain kubernetes: queued: JobSet ml/r waits'; sleep 0.2; "
                       "echo 'jaxtrain kubernetes: admitted by Kueue after 1 s queued'; "
                       "echo '0: training'",
                       "sh"};
  auto c = Config({.num_workers = 2});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok());
  KubernetesLauncher launcher(o, c, *plan);
  std::vector<ProcessSpec> specs = {{{0}, {"python"}, {}, {}, "", "ab"},
                                    {{1}, {"python"}, {}, {}, "", "ab"}};
  EXPECT_TRUE(launcher.MayQueue());
  auto launched = launcher.Launch(specs);
  ASSERT_TRUE(launched.ok()) << launched.status().message();
  // It waited between "queued" and "admitted" (the supervisor's sleep).
  EXPECT_GT(launcher.QueueWait(), 0.0);
  int status = 0;
  waitpid((*launched)[0].pid, &status, 0);
  // What follows the admission is the controller's to read: the ranks' output.
  std::string rest(64, '\0');
  ssize_t n = read((*launched)[0].output_fd, rest.data(), rest.size());
  ASSERT_GT(n, 0);
  EXPECT_EQ(rest.substr(0, static_cast<size_t>(n)), "0: training\n");
  close((*launched)[0].pidfd);
  close((*launched)[0].output_fd);

  // Interrupted: no JobSet is asked for.
  launcher.Interrupt();
  EXPECT_EQ(launcher.Launch(specs).status().code(), StatusCode::kCancelled);
  launcher.EndRun(/*keep=*/false);
  rmdir(base);
}

TEST(KubernetesOptionsTest, NamesTheMissingField) {
  auto o = KubernetesOptions::FromJson({{"namespace", "ml"}, {"name", "r"}});
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("'image'"), std::string::npos);
}

TEST(JobSetManifestTest, AQueuedJobSetCarriesKueuesLabelsAndStartsSuspended) {
  auto m = Manifest(Config({.num_workers = 2}), Queued("team-a", "low"));
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ((*m)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], "team-a");
  EXPECT_EQ((*m)["metadata"]["labels"]["kueue.x-k8s.io/priority-class"], "low");
  EXPECT_EQ((*m)["spec"]["suspend"], true);
  // Kueue manages the JobSet as one workload: its pods do not carry the labels.
  EXPECT_FALSE(Pod(*m)["metadata"]["labels"].contains("kueue.x-k8s.io/queue-name"));

  auto plain = Manifest(Config({.num_workers = 2}), Options());
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)["spec"]["suspend"], false);
  EXPECT_FALSE((*plain)["metadata"]["labels"].contains("kueue.x-k8s.io/queue-name"));
}

TEST(KubernetesOptionsTest, RefusesKueueNamesThatCannotBeLabels) {
  json j = {{"namespace", "ml"},
            {"name", "r"},
            {"image", "i"},
            {"request_dir", "/tmp"},
            {"worker_command", {"python"}},
            {"supervisor_argv", {"python"}}};
  for (const std::string& bad : std::vector<std::string>{"Team_A", "-a", std::string(64, 'a')}) {
    j["queue_name"] = bad;
    auto o = KubernetesOptions::FromJson(j);
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(o.status().message().find("JAXTRAIN_K8S_QUEUE_NAME='" + bad + "'"), std::string::npos)
        << o.status().message();
  }
  j["queue_name"] = "";
  j["priority_class"] = "high";
  auto o = KubernetesOptions::FromJson(j);
  EXPECT_NE(o.status().message().find("set JAXTRAIN_K8S_QUEUE_NAME"), std::string::npos)
      << o.status().message();
}

TEST(ParseKubernetesTaskEndTest, ReadsTheSupervisorsLines) {
  auto exited =
      ParseKubernetesTaskEnd("jaxtrain kubernetes: rank 3 on node-7: exited with status 3\n");
  ASSERT_TRUE(exited.has_value());
  EXPECT_EQ(exited->tasks, std::vector<int>{3});
  EXPECT_EQ(exited->node, "node-7");
  EXPECT_EQ(exited->exit.exit_code, 3);

  auto killed = ParseKubernetesTaskEnd("jaxtrain kubernetes: rank 0 on n1: killed by signal 9");
  ASSERT_TRUE(killed.has_value());
  EXPECT_EQ(killed->exit.signal, 9);

  auto lost = ParseKubernetesTaskEnd("jaxtrain kubernetes: rank 1 on n1: deleted (node lost)");
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(lost->exit.signal, SIGKILL);

  for (const char* other : {"jaxtrain kubernetes: error: quota", "0: hello", "rank 1 on x: y",
                            "jaxtrain kubernetes: rank x on n: exited with status 1"}) {
    EXPECT_FALSE(ParseKubernetesTaskEnd(other).has_value()) << other;
  }
}

// --- elastic runs ---------------------------------------------------------------------------

TEST(PodSlotsTest, AnElasticRunsPodsAreItsHostsAndAFewerOnesJobSetHasFewerPods) {
  auto c = Config({.num_workers = 4, .min_workers = 2});
  accelerators::FakeHost host;
  auto slots = PlanOnPodSlots(c, host, 4);
  ASSERT_TRUE(slots.ok()) << slots.status().message();
  ASSERT_EQ(slots->workers.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(slots->workers[r].host, "pod-" + std::to_string(r));
    EXPECT_EQ(slots->workers[r].slice, "");
  }
  auto fewer = PlanOnPodSlots(c, host, 2);
  ASSERT_TRUE(fewer.ok()) << fewer.status().message();
  ASSERT_EQ(fewer->workers.size(), 2u);
  auto m = JobSetManifest(c, *fewer, Options(), "run-abcde-2", {});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ((*m)["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"], 2);
  EXPECT_EQ(Env(Pod(*m), "JAXTRAIN_K8S_PODS_PER_JOB").value()["value"], "2");
}

TEST(PodSlotsTest, TheCapacityQueryIsAskedAboutOnePodOfTheRun) {
  auto c = Config({.num_workers = 2, .min_workers = 1, .resources_per_worker = {{"CPU", 1.5}}});
  accelerators::FakeHost host;
  auto plan = PlanForKubernetes(c, host);
  ASSERT_TRUE(plan.ok());
  auto shape = CapacityShape(c, *plan, Options());
  ASSERT_TRUE(shape.ok()) << shape.status().message();
  EXPECT_EQ((*shape)["run"], "run-abcde");
  EXPECT_EQ((*shape)["pods_per_job"], 2);
  EXPECT_EQ((*shape)["pod"]["containers"][0]["resources"]["requests"]["cpu"], "1.5");
}

TEST(ParsePodRoomTest, ReadsTheRoomTheNodesWithoutItAndThePodsLeaving) {
  auto room = ParsePodRoom(
      R"({"room": 1, "why": {"node2": "cordoned", "node3": "not Ready"}, "leaving": [[1, "node2"]]})");
  ASSERT_TRUE(room.ok()) << room.status().message();
  EXPECT_EQ(room->room, 1);
  EXPECT_EQ(room->why, "node2: cordoned; node3: not Ready");
  ASSERT_EQ(room->leaving.size(), 1u);
  EXPECT_EQ(room->leaving[0], (std::pair<int, std::string>{1, "node2"}));

  auto error = ParsePodRoom(R"({"error": "cannot list the cluster's nodes and pods: HTTP 403"})");
  EXPECT_EQ(error.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(error.status().message(), "cannot list the cluster's nodes and pods: HTTP 403");
  for (const char* bad : {"", "Traceback (most recent call last):", R"({"room": "2"})",
                          R"({"room": 2, "why": {}, "leaving": [3]})"}) {
    EXPECT_EQ(ParsePodRoom(bad).status().code(), StatusCode::kUnavailable) << bad;
  }
}

// A launcher whose capacity query is a shell script printing `answer`.
KubernetesLauncher RoomLauncher(const std::string& answer, const config::ScalingConfig& c) {
  KubernetesOptions o = Options();
  o.supervisor_argv = {"sh", "-c", "echo '" + answer + "'", "sh"};
  accelerators::FakeHost host;
  return KubernetesLauncher(o, c, *PlanForKubernetes(c, host));
}

TEST(KubernetesLauncherTest, ThePodSlotsBeyondTheClustersRoomAreUnreachable) {
  auto c = Config({.num_workers = 3, .min_workers = 1});
  const std::vector<std::string> slots = {"pod-0", "pod-1", "pod-2"};
  KubernetesLauncher two =
      RoomLauncher(R"({"room": 2, "why": {"n3": "cordoned"}, "leaving": []})", c);
  auto down = two.UnreachableHosts(slots, Duration::zero(), -1);
  ASSERT_TRUE(down.ok()) << down.status().message();
  EXPECT_EQ(*down, std::vector<std::string>{"pod-2"});
  // The monitor asks about the missing slots only.
  EXPECT_EQ(*two.UnreachableHosts({"pod-2"}, Duration::zero(), -1),
            std::vector<std::string>{"pod-2"});

  // One pod on a cordoned node: the last slot of those the group trains on leaves.
  KubernetesLauncher leaving =
      RoomLauncher(R"({"room": 2, "why": {"n1": "cordoned"}, "leaving": [[0, "n1"]]})", c);
  auto left = leaving.LeavingHosts(slots, -1);
  ASSERT_TRUE(left.ok()) << left.status().message();
  EXPECT_EQ(*left, std::vector<std::string>{"pod-2"});

  // A query that cannot be made takes every slot as there.
  KubernetesLauncher denied = RoomLauncher(R"({"error": "HTTP 403 Forbidden"})", c);
  EXPECT_TRUE(denied.UnreachableHosts(slots, Duration::zero(), -1)->empty());
  EXPECT_TRUE(denied.LeavingHosts(slots, -1)->empty());
  denied.Interrupt();
  EXPECT_EQ(denied.UnreachableHosts(slots, Duration::zero(), -1).status().code(),
            StatusCode::kCancelled);
}

TEST(KubernetesLauncherTest, ARoomTooSmallIsAskedAgainUntilTheWaitEnds) {
  char dir[] = "/tmp/kubernetes-room-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string count = std::string(dir) + "/asked";
  auto c = Config({.num_workers = 2, .min_workers = 1});
  // Room for 1 the first time it is asked, for 2 after.
  KubernetesOptions o = Options();
  o.supervisor_argv = {"sh", "-c",
                       "if [ -e " + count +
                           " ]; then echo '{\"room\": 2, \"why\": {}, "
                           "\"leaving\": []}'; else touch " +
                           count + "; echo '{\"room\": 1, \"why\": {}, \"leaving\": []}'; fi",
                       "sh"};
  accelerators::FakeHost host;
  KubernetesLauncher launcher(o, c, *PlanForKubernetes(c, host));
  auto down = launcher.UnreachableHosts({"pod-0", "pod-1"}, std::chrono::seconds(30), -1);
  ASSERT_TRUE(down.ok()) << down.status().message();
  EXPECT_TRUE(down->empty());
  unlink(count.c_str());
  rmdir(dir);
}

TEST(PodSlotsTest, ATpuRunResizesByWholeSlicesEachAJobWithItsOwnMegascale) {
  // v4 2x2x2: 2 hosts of 4 chips a slice; (2, 4) workers = 1 or 2 slices.
  auto c = Config({.num_workers = 4,
                   .min_workers = 2,
                   .use_tpu = true,
                   .topology = "2x2x2",
                   .accelerator_type = "TPU-V4"});
  accelerators::FakeHost host;
  auto two = PlanOnPodSlots(c, host, 4);
  ASSERT_TRUE(two.ok()) << two.status().message();
  std::vector<std::string> slices;
  for (const auto& w : two->workers) slices.push_back(w.slice);
  EXPECT_EQ(slices, (std::vector<std::string>{"slice-0", "slice-0", "slice-1", "slice-1"}));
  auto m = JobSetManifest(c, *two, Options(), "run-abcde-1", {});
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ((*m)["spec"]["replicatedJobs"][0]["replicas"], 2);
  EXPECT_EQ(Env(Pod(*m), "MEGASCALE_NUM_SLICES").value()["value"], "2");

  auto one = PlanOnPodSlots(c, host, 2);
  ASSERT_TRUE(one.ok()) << one.status().message();
  m = JobSetManifest(c, *one, Options(), "run-abcde-2", {});
  ASSERT_TRUE(m.ok()) << m.status().message();
  const json& job = (*m)["spec"]["replicatedJobs"][0];
  EXPECT_EQ(job["replicas"], 1);
  EXPECT_EQ(job["template"]["spec"]["parallelism"], 2);
  EXPECT_FALSE(Env(Pod(*m), "MEGASCALE_NUM_SLICES").has_value());  // one slice: none, not stale
  EXPECT_EQ(PlanOnPodSlots(c, host, 3).status().code(), StatusCode::kInvalidArgument);

  auto shape = CapacityShape(c, *two, Options());
  ASSERT_TRUE(shape.ok()) << shape.status().message();
  EXPECT_EQ((*shape)["slice_pods"], 2);
  EXPECT_EQ((*shape)["slice_domain"], "cloud.google.com/gke-nodepool");

  // Simulated on CPU pods, each rank's TPU environment is made for the slices of its plan.
  accelerators::FakeHost simulated;
  simulated.env["JAXTRAIN_SIMULATE"] = "1";
  auto sim_two = PlanOnPodSlots(c, simulated, 4);
  auto sim_one = PlanOnPodSlots(c, simulated, 2);
  ASSERT_TRUE(sim_two.ok() && sim_one.ok());
  EXPECT_EQ(sim_two->workers[3].env.at("MEGASCALE_NUM_SLICES"), "2");
  EXPECT_EQ(sim_one->workers[1].env.count("MEGASCALE_NUM_SLICES"), 0u);
  EXPECT_EQ(sim_one->workers[1].env.at("TPU_WORKER_ID"), "1");

  KubernetesLauncher launcher(Options(), c, *two);
  EXPECT_TRUE(launcher.UsePlan(*one).ok());
  placement::Plan broken = *two;
  broken.workers.pop_back();
  EXPECT_EQ(launcher.UsePlan(broken).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace jaxtrain::launch
