#include "launch/kubernetes_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "base/fd_io.h"
#include "base/strings.h"
#include "placement/elastic.h"

namespace jaxtrain::launch {
namespace {

using nlohmann::json;

// Set per pod by each worker from its Job's index and completion index, never by the launcher.
const std::set<std::string> kPerRankEnv = {"JAXTRAIN_RANK", "JAXTRAIN_LOCAL_RANK",
                                           "JAXTRAIN_LOCAL_WORLD_SIZE", "JAXTRAIN_NODE_RANK"};
// Never handed on to the supervisor: a driver that is itself a worker of another run has these.
const std::set<std::string> kSecretEnv = {"JAXTRAIN_RUN_SECRET", "JAXTRAIN_RUN_SECRET_FILE",
                                          "JAXTRAIN_RUN_SECRET_FD"};
constexpr char kSecretDir[] = "/var/run/jaxtrain";
constexpr char kJobIndexLabel[] = "jobset.sigs.k8s.io/job-index";
constexpr char kDefaultMegascalePort[] = "8081";
constexpr char kKueueQueueLabel[] = "kueue.x-k8s.io/queue-name";
constexpr char kKueuePriorityLabel[] = "kueue.x-k8s.io/priority-class";
// The supervisor's lines while its JobSet waits for Kueue
// (python/jaxtrain/kubernetes/supervisor.py).
constexpr std::string_view kSupervisorPrefix = "jaxtrain kubernetes: ";
constexpr std::string_view kAdmittedLine = "jaxtrain kubernetes: admitted";
// Where a supervisor leaves the JobSet it kept for the next attempt (restarts in place;
// python/jaxtrain/kubernetes/supervisor.py, KEPT_FILE).
constexpr char kKeptFile[] = "kept.json";

// Says a line of the supervisor's on the driver's stderr, as "jaxtrain: kubernetes: ...".
void SaySupervisorLine(std::string_view line) {
  if (line.substr(0, kSupervisorPrefix.size()) == kSupervisorPrefix) {
    line.remove_prefix(kSupervisorPrefix.size());
  }
  Say("kubernetes: " + std::string(line));
}

// Ranks per Job and Jobs of the group: a TPU slice per Job, or one Job for every worker.
struct Shape {
  int pods_per_job = 1;
  int jobs = 1;
  std::string replicated_job = "workers";
};

Shape ShapeOf(const config::ScalingConfig& config, const placement::Plan& plan) {
  if (config.use_tpu() && config.tpu_slice()) {
    // An elastic run's plan may hold fewer slices than the config's max.
    return {.pods_per_job = config.workers_per_slice(),
            .jobs = static_cast<int>(plan.workers.size()) / config.workers_per_slice(),
            .replicated_job = "slice"};
  }
  return {.pods_per_job = static_cast<int>(plan.workers.size())};  // an elastic run's: fewer
}

StatusOr<std::string> String(const json& j, const char* field, bool required) {
  if (!j.contains(field) || j[field].is_null()) {
    if (required) {
      return InvalidArgumentError(std::string("Kubernetes options: '") + field + "' is missing");
    }
    return std::string();
  }
  if (!j[field].is_string()) {
    return InvalidArgumentError(std::string("Kubernetes options: '") + field +
                                "' must be a string, not " + j[field].dump());
  }
  return j[field].get<std::string>();
}

StatusOr<std::vector<std::string>> Strings(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_array() || j[field].empty()) {
    return InvalidArgumentError(std::string("Kubernetes options: '") + field +
                                "' must be a non-empty list of strings");
  }
  std::vector<std::string> out;
  for (const auto& v : j[field]) {
    if (!v.is_string()) {
      return InvalidArgumentError(std::string("Kubernetes options: '") + field +
                                  "' must be a list of strings, not " + j[field].dump());
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

// A Kueue object's name as a label value: a DNS subdomain name of at most 63 characters.
StatusOr<std::string> KueueName(const json& j, const char* field, const char* setting) {
  JT_ASSIGN_OR_RETURN(std::string name, String(j, field, false));
  if (name.empty()) return name;
  const bool chars =
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-.") == std::string::npos;
  auto alnum = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  if (name.size() > 63 || !chars || !alnum(name.front()) || !alnum(name.back())) {
    return InvalidArgumentError(
        std::string(setting) + "='" + name +
        "' is not allowed: it names a Kueue object in a label, so it must be at most 63 "
        "characters of lower-case letters, digits, '-' and '.', starting and ending with a "
        "letter or digit");
  }
  return name;
}

json EnvVar(const std::string& name, const std::string& value) {
  return {{"name", name}, {"value", value}};
}

// jaxtrain's own settings stay in the pod spec; everything else is read from the Secret.
bool PlainEnv(const std::string& name) { return name.rfind("JAXTRAIN_", 0) == 0; }

// A Secret's data key: [-._a-zA-Z0-9]+, at most 253 characters.
bool IsSecretKey(std::string_view key) {
  return !key.empty() && key.size() <= 253 &&
         key.find_first_not_of(
             "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._") ==
             std::string_view::npos;
}

// The mode of the run key's file in the Secret volume. A Secret volume's files are owned by root
// and, with spec.securityContext.fsGroup, by that group: a worker running as root reads 0400; one
// running as another user reads the file only through fsGroup (0440), and is refused without it.
StatusOr<int> SecretFileMode(const json& spec) {
  auto field = [](const json& o, const char* section, const char* name) -> const json* {
    if (!o.is_object() || !o.contains(section) || !o[section].is_object()) return nullptr;
    const json& s = o[section];
    return s.contains(name) && !s[name].is_null() ? &s[name] : nullptr;
  };
  const json& container = spec["containers"][0];
  std::string where = "spec.containers[0].securityContext.runAsUser";
  const json* user = field(container, "securityContext", "runAsUser");
  if (user == nullptr) {
    where = "spec.securityContext.runAsUser";
    user = field(spec, "securityContext", "runAsUser");
  }
  std::string non_root_where = "spec.containers[0].securityContext.runAsNonRoot";
  const json* non_root = field(container, "securityContext", "runAsNonRoot");
  if (non_root == nullptr) {
    non_root_where = "spec.securityContext.runAsNonRoot";
    non_root = field(spec, "securityContext", "runAsNonRoot");
  }
  std::string as;
  if (user != nullptr && user->is_number_integer() && user->get<long long>() != 0) {
    as = where + "=" + user->dump();
  } else if (user == nullptr && non_root != nullptr && non_root->is_boolean() &&
             non_root->get<bool>()) {
    as = non_root_where + "=true";
  }
  if (as.empty()) return 0400;
  if (field(spec, "securityContext", "fsGroup") != nullptr) return 0440;
  return InvalidArgumentError(
      "the worker pod template runs the worker as a user other than root (" + as +
      ") without spec.securityContext.fsGroup: the run's key, a file of a Secret volume owned by "
      "root, would be unreadable to it; set spec.securityContext.fsGroup in "
      "JAXTRAIN_K8S_POD_TEMPLATE (e.g. to the worker's group id), which the file is then "
      "readable by (mode 0440)");
}

// Adds `ours` to the env list `into`, replacing entries of the same name.
void MergeEnv(json& into, const json& ours) {
  if (!into.is_array()) into = json::array();
  for (const auto& e : ours) {
    bool replaced = false;
    for (auto& existing : into) {
      if (existing.value("name", "") == e.value("name", "")) {
        existing = e;
        replaced = true;
      }
    }
    if (!replaced) into.push_back(e);
  }
}

void MergeObject(json& into, const json& ours) {
  if (!into.is_object()) into = json::object();
  for (const auto& [k, v] : ours.items()) into[k] = v;
}

std::string Quantity(double v) {
  if (std::floor(v) == v) return std::to_string(static_cast<long long>(v));
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  return s;
}

}  // namespace

StatusOr<KubernetesOptions> KubernetesOptions::FromJson(const json& j) {
  if (!j.is_object()) return InvalidArgumentError("Kubernetes options must be a JSON object");
  KubernetesOptions o;
  JT_ASSIGN_OR_RETURN(o.namespace_name, String(j, "namespace", true));
  JT_ASSIGN_OR_RETURN(o.name, String(j, "name", true));
  JT_ASSIGN_OR_RETURN(o.image, String(j, "image", true));
  JT_ASSIGN_OR_RETURN(o.image_pull_policy, String(j, "image_pull_policy", false));
  JT_ASSIGN_OR_RETURN(o.service_account, String(j, "service_account", false));
  JT_ASSIGN_OR_RETURN(o.request_dir, String(j, "request_dir", true));
  JT_ASSIGN_OR_RETURN(o.worker_command, Strings(j, "worker_command"));
  JT_ASSIGN_OR_RETURN(o.supervisor_argv, Strings(j, "supervisor_argv"));
  if (j.contains("pending_timeout_s")) {
    if (!j["pending_timeout_s"].is_number() || j["pending_timeout_s"].get<double>() <= 0) {
      return InvalidArgumentError("Kubernetes options: 'pending_timeout_s' must be a number > 0");
    }
    o.pending_timeout_s = j["pending_timeout_s"].get<double>();
  }
  o.pod_template = j.value("pod_template", json());
  if (!o.pod_template.is_null() &&
      (!o.pod_template.is_object() ||
       (o.pod_template.contains("spec") && !o.pod_template["spec"].is_object()))) {
    return InvalidArgumentError(
        "the worker pod template must be a Pod-shaped object ({\"metadata\": {...}, \"spec\": "
        "{...}}), not " +
        o.pod_template.dump().substr(0, 200));
  }
  o.owner = j.value("owner", json());
  JT_ASSIGN_OR_RETURN(o.queue_name, KueueName(j, "queue_name", "JAXTRAIN_K8S_QUEUE_NAME"));
  JT_ASSIGN_OR_RETURN(o.priority_class,
                      KueueName(j, "priority_class", "JAXTRAIN_K8S_PRIORITY_CLASS"));
  if (!o.priority_class.empty() && o.queue_name.empty()) {
    return InvalidArgumentError(
        "JAXTRAIN_K8S_PRIORITY_CLASS='" + o.priority_class +
        "' is a Kueue WorkloadPriorityClass, which only a queued JobSet has: set "
        "JAXTRAIN_K8S_QUEUE_NAME to the LocalQueue too (a pod PriorityClass goes in the pod "
        "template's spec.priorityClassName)");
  }
  if (j.contains("labels") && j["labels"].is_object()) {
    for (const auto& [k, v] : j["labels"].items()) {
      if (v.is_string()) o.labels[k] = v.get<std::string>();
    }
  }
  return o;
}

StatusOr<std::string> GkeTpuAccelerator(accelerators::TpuGeneration generation) {
  using accelerators::TpuGeneration;
  switch (generation) {
    case TpuGeneration::kV4: return std::string("tpu-v4-podslice");
    case TpuGeneration::kV5e: return std::string("tpu-v5-lite-podslice");
    case TpuGeneration::kV5p: return std::string("tpu-v5p-slice");
    case TpuGeneration::kV6e: return std::string("tpu-v6e-slice");
    case TpuGeneration::kV7x: return std::string("tpu7x");
    default: break;
  }
  return InvalidArgumentError("ScalingConfig.accelerator_type: TPU " +
                              std::string(accelerators::GenerationName(generation)) +
                              " is not offered on GKE; GKE offers v4, v5e (v5litepod), v5p, v6e "
                              "and v7x");
}

namespace {

// What one pod per worker cannot give (see PlanForKubernetes).
Status CheckShape(const config::ScalingConfig& config) {
  if (config.use_tpu()) {
    if (!config.input().accelerator_type && !config.tpu_slice()) {
      return InvalidArgumentError(
          "ScalingConfig.accelerator_type is not set: on Kubernetes a TPU ScalingConfig needs it "
          "(e.g. 'TPU-V6E') to select GKE's TPU nodes");
    }
    auto generation = config.tpu_slice()
                          ? StatusOr<accelerators::TpuGeneration>(config.tpu_slice()->generation)
                          : accelerators::ParseTpuGeneration(*config.input().accelerator_type);
    JT_RETURN_IF_ERROR(generation.status());
    JT_RETURN_IF_ERROR(GkeTpuAccelerator(*generation).status());
    if (config.tpu_slice() && config.workers_per_slice() != config.tpu_slice()->hosts) {
      return InvalidArgumentError(
          "ScalingConfig.resources_per_worker: on Kubernetes one worker runs per TPU VM host (one "
          "pod each), so a worker takes a host's " +
          std::to_string(config.tpu_slice()->chips_per_host) + " chips; this config gives " +
          std::to_string(config.workers_per_slice() / config.tpu_slice()->hosts) +
          " workers per host (leave 'TPU' out of resources_per_worker)");
    }
  }
  if (config.use_gpu()) {
    double gpus = config.resources_per_worker().at("GPU");
    if (std::floor(gpus) != gpus || gpus < 1) {
      return InvalidArgumentError("ScalingConfig.resources_per_worker['GPU']=" + Quantity(gpus) +
                                  " is not allowed on Kubernetes: nvidia.com/gpu is a whole "
                                  "number >= 1 per pod");
    }
  }
  return OkStatus();
}

}  // namespace

std::map<std::string, std::string> SecretEnv(const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> data;
  for (const auto& [k, v] : env) {
    if (!PlainEnv(k)) data[kSecretEnvPrefix + k] = v;
  }
  return data;
}

StatusOr<placement::Plan> PlanForKubernetes(const config::ScalingConfig& config,
                                            const accelerators::HostView& env) {
  JT_RETURN_IF_ERROR(CheckShape(config));
  return placement::PlanForScheduler(config, env);
}

StatusOr<json> JobSetRequest(const config::ScalingConfig& config, const placement::Plan& plan,
                             const KubernetesOptions& options, const std::string& jobset_name,
                             const std::vector<ProcessSpec>& specs) {
  JT_ASSIGN_OR_RETURN(UniformGroup group, MergeUniform(specs, kPerRankEnv, "Kubernetes",
                                                       placement::kPerRankPlacementVariables));
  if (group.secret.empty()) return InternalError("the Kubernetes launcher was given no run key");
  JT_ASSIGN_OR_RETURN(json jobset, JobSetManifest(config, plan, options, jobset_name, group.env));
  return json{
      {"namespace", options.namespace_name},
      {"jobset", std::move(jobset)},
      {"secret", {{"name", jobset_name}, {"key", group.secret}, {"env", SecretEnv(group.env)}}},
      {"ranks", group.ranks.size()},
      {"pending_timeout_s", options.pending_timeout_s},
      {"queue_name", options.queue_name}};
}

StatusOr<json> JobSetManifest(const config::ScalingConfig& config, const placement::Plan& plan,
                              const KubernetesOptions& options, const std::string& jobset_name,
                              const std::map<std::string, std::string>& env) {
  JT_RETURN_IF_ERROR(CheckShape(config));
  const Shape shape = ShapeOf(config, plan);

  json labels = {{"app.kubernetes.io/managed-by", "jaxtrain"}, {"jaxtrain.dev/run", options.name}};
  for (const auto& [k, v] : options.labels) labels[k] = v;

  json container_env = json::array();
  for (const auto& [k, v] : env) {
    if (PlainEnv(k)) {
      container_env.push_back(EnvVar(k, v));
      continue;
    }
    const std::string key = kSecretEnvPrefix + k;
    if (!IsSecretKey(key)) {
      return InvalidArgumentError("the worker environment variable '" + k +
                                  "' cannot be passed to Kubernetes pods: its value travels in "
                                  "the run's Secret, whose keys are letters, digits, '-', '_' and "
                                  "'.'; rename it");
    }
    json ref = {{"name", jobset_name}, {"key", key}};
    container_env.push_back({{"name", k}, {"valueFrom", {{"secretKeyRef", ref}}}});
  }
  container_env.push_back(EnvVar("JAXTRAIN_RUN_SECRET_FILE", std::string(kSecretDir) + "/secret"));
  container_env.push_back(EnvVar("JAXTRAIN_K8S_PODS_PER_JOB", std::to_string(shape.pods_per_job)));
  container_env.push_back(
      {{"name", "JAXTRAIN_K8S_JOB_INDEX"},
       {"valueFrom",
        {{"fieldRef",
          {{"fieldPath", std::string("metadata.labels['") + kJobIndexLabel + "']"}}}}}});

  json limits = json::object();
  json requests = json::object();
  json node_selector = json::object();
  json jobset_annotations = json::object();
  const auto& raw = config.input().resources_per_worker;
  if (config.use_tpu()) {
    auto generation = config.tpu_slice()
                          ? StatusOr<accelerators::TpuGeneration>(config.tpu_slice()->generation)
                          : accelerators::ParseTpuGeneration(*config.input().accelerator_type);
    JT_ASSIGN_OR_RETURN(std::string accelerator, GkeTpuAccelerator(*generation));
    node_selector["cloud.google.com/gke-tpu-accelerator"] = accelerator;
    const double chips = config.tpu_slice() ? config.tpu_slice()->chips_per_host
                                            : config.resources_per_worker().at("TPU");
    limits["google.com/tpu"] = Quantity(chips);
    if (config.tpu_slice()) {
      node_selector["cloud.google.com/gke-tpu-topology"] = config.tpu_slice()->topology;
      // A slice is one Job, placed whole on one node pool (a TPU slice) or not at all.
      jobset_annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] =
          "cloud.google.com/gke-nodepool";
    }
    if (shape.jobs > 1 && !plan.simulated) {
      container_env.push_back(EnvVar("MEGASCALE_NUM_SLICES", std::to_string(shape.jobs)));
      container_env.push_back(
          EnvVar("MEGASCALE_COORDINATOR_ADDRESS",
                 jobset_name + "-" + shape.replicated_job + "-0-0." + jobset_name));
      if (!env.count("MEGASCALE_PORT")) {
        container_env.push_back(EnvVar("MEGASCALE_PORT", kDefaultMegascalePort));
      }
      container_env.push_back(
          {{"name", "MEGASCALE_SLICE_ID"},
           {"valueFrom",
            {{"fieldRef",
              {{"fieldPath", std::string("metadata.labels['") + kJobIndexLabel + "']"}}}}}});
    }
  } else if (config.use_gpu()) {
    limits["nvidia.com/gpu"] = Quantity(config.resources_per_worker().at("GPU"));
  }
  if (auto cpu = raw.find("CPU"); cpu != raw.end()) requests["cpu"] = Quantity(cpu->second);
  if (auto mem = raw.find("memory"); mem != raw.end()) requests["memory"] = Quantity(mem->second);

  // The user's template first; what jaxtrain must decide is set over it.
  json pod = options.pod_template.is_object() ? options.pod_template : json::object();
  json& meta = pod["metadata"];
  if (!meta.is_object()) meta = json::object();
  MergeObject(meta["labels"], labels);
  json& spec = pod["spec"];
  if (!spec.is_object()) spec = json::object();
  json& containers = spec["containers"];
  if (!containers.is_array() || containers.empty()) containers = json::array({json::object()});
  json& c = containers[0];
  if (!c.contains("name")) c["name"] = "worker";
  if (!options.image.empty()) c["image"] = options.image;
  if (!options.image_pull_policy.empty()) c["imagePullPolicy"] = options.image_pull_policy;
  c["command"] = options.worker_command;
  MergeEnv(c["env"], container_env);
  json& resources = c["resources"];
  if (!resources.is_object()) resources = json::object();
  if (!limits.empty()) MergeObject(resources["limits"], limits);
  if (!requests.empty()) MergeObject(resources["requests"], requests);
  if (resources.empty()) c.erase("resources");
  json& mounts = c["volumeMounts"];
  if (!mounts.is_array()) mounts = json::array();
  mounts.push_back(
      {{"name", "jaxtrain-run-secret"}, {"mountPath", kSecretDir}, {"readOnly", true}});
  JT_ASSIGN_OR_RETURN(const int secret_mode, SecretFileMode(spec));
  json& volumes = spec["volumes"];
  if (!volumes.is_array()) volumes = json::array();
  volumes.push_back({{"name", "jaxtrain-run-secret"},
                     {"secret",
                      {{"secretName", jobset_name},
                       {"defaultMode", secret_mode},
                       {"items", json::array({{{"key", "secret"}, {"path", "secret"}}})}}}});
  spec["restartPolicy"] = "Never";
  if (!node_selector.empty()) MergeObject(spec["nodeSelector"], node_selector);
  if (!options.service_account.empty()) spec["serviceAccountName"] = options.service_account;
  if (!spec.contains("terminationGracePeriodSeconds")) spec["terminationGracePeriodSeconds"] = 5;
  // Workers never call the API server: no token of the service account unless the template asks.
  if (!spec.contains("automountServiceAccountToken")) spec["automountServiceAccountToken"] = false;

  // Kueue's labels go on the JobSet only: Kueue manages it as one workload.
  json jobset_labels = labels;
  if (!options.queue_name.empty()) jobset_labels[kKueueQueueLabel] = options.queue_name;
  if (!options.priority_class.empty()) jobset_labels[kKueuePriorityLabel] = options.priority_class;
  json metadata = {
      {"name", jobset_name}, {"namespace", options.namespace_name}, {"labels", jobset_labels}};
  if (!jobset_annotations.empty()) metadata["annotations"] = jobset_annotations;
  if (!options.owner.is_null()) metadata["ownerReferences"] = json::array({options.owner});
  return json{{"apiVersion", "jobset.x-k8s.io/v1alpha2"},
              {"kind", "JobSet"},
              {"metadata", metadata},
              {"spec",
               {// Queued: no pod starts before Kueue admits it (and unsuspends it).
                {"suspend", !options.queue_name.empty()},
                {"failurePolicy", {{"maxRestarts", 0}}},
                {"network", {{"enableDNSHostnames", true}, {"publishNotReadyAddresses", true}}},
                {"replicatedJobs", json::array({{{"name", shape.replicated_job},
                                                 {"replicas", shape.jobs},
                                                 {"template",
                                                  {{"metadata", {{"labels", labels}}},
                                                   {"spec",
                                                    {{"parallelism", shape.pods_per_job},
                                                     {"completions", shape.pods_per_job},
                                                     {"completionMode", "Indexed"},
                                                     {"backoffLimit", 0},
                                                     {"template", pod}}}}}}})}}}};
}

std::optional<TaskEnd> ParseKubernetesTaskEnd(std::string_view line) {
  constexpr std::string_view kPrefix = "jaxtrain kubernetes: rank ";
  if (line.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  line.remove_prefix(kPrefix.size());
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  size_t digits = line.find_first_not_of("0123456789");
  if (digits == 0 || digits == std::string_view::npos || digits > 7) return std::nullopt;
  TaskEnd end;
  end.tasks = {std::atoi(std::string(line.substr(0, digits)).c_str())};
  line.remove_prefix(digits);
  if (line.substr(0, 4) != " on ") return std::nullopt;
  line.remove_prefix(4);
  size_t colon = line.find(": ");
  if (colon == std::string_view::npos) return std::nullopt;
  end.node = std::string(line.substr(0, colon));
  std::string_view how = line.substr(colon + 2);
  auto number_after = [&](std::string_view prefix) -> std::optional<int> {
    if (how.substr(0, prefix.size()) != prefix) return std::nullopt;
    std::string_view n = how.substr(prefix.size());
    size_t len = n.find_first_not_of("0123456789");
    if (len == 0) return std::nullopt;
    return std::atoi(std::string(n.substr(0, len)).c_str());
  };
  if (auto code = number_after("exited with status ")) {
    end.exit.exit_code = *code;
  } else if (auto sig = number_after("killed by signal ")) {
    end.exit.signal = *sig;
  } else {
    end.exit.signal = SIGKILL;  // deleted, evicted, its node lost: the process did not exit itself
  }
  return end;
}

StatusOr<placement::Plan> PlanOnPodSlots(const config::ScalingConfig& config,
                                         const accelerators::HostView& env, int workers) {
  config::ScalingConfigInput input = config.input();
  input.num_workers = workers;
  input.min_workers.reset();
  JT_ASSIGN_OR_RETURN(config::ScalingConfig sized, config::ScalingConfig::Create(input));
  JT_ASSIGN_OR_RETURN(placement::Plan plan, PlanForKubernetes(sized, env));
  std::vector<std::string> slots;
  for (int r = 0; r < workers; ++r) slots.push_back(kPodSlotPrefix + std::to_string(r));
  JT_ASSIGN_OR_RETURN(plan, placement::PlanPerHost(plan, slots, 1, workers, "Kubernetes pods"));
  if (sized.use_tpu() && sized.tpu_slice()) {
    for (placement::WorkerPlacement& w : plan.workers) {
      w.slice = "slice-" + std::to_string(w.rank / sized.workers_per_slice());
    }
  }
  return plan;
}

StatusOr<json> CapacityShape(const config::ScalingConfig& config, const placement::Plan& plan,
                             const KubernetesOptions& options) {
  JT_ASSIGN_OR_RETURN(json jobset, JobSetManifest(config, plan, options, "capacity", {}));
  const json& job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"];
  json shape = {{"run", options.name},
                {"pod", job["template"]["spec"]},
                {"pods_per_job", job["parallelism"]}};
  if (config.use_tpu() && config.tpu_slice()) {
    shape["slice_pods"] = config.workers_per_slice();
    shape["slice_domain"] = "cloud.google.com/gke-nodepool";  // JobSet's exclusive topology
  }
  return shape;
}

StatusOr<PodRoom> ParsePodRoom(std::string_view output) {
  const json j = json::parse(output, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_string()) {
    return UnavailableError(j["error"].get<std::string>());
  }
  if (!j.is_object() || !j.contains("room") || !j["room"].is_number_integer() ||
      !j.value("why", json()).is_object() || !j.value("leaving", json()).is_array()) {
    return UnavailableError("the capacity query's answer is not what was expected: " +
                            std::string(output.substr(0, 500)));
  }
  PodRoom room{.room = j["room"].get<int>()};
  for (const auto& [node, why] : j["why"].items()) {
    room.why += (room.why.empty() ? "" : "; ") + node + ": " +
                (why.is_string() ? why.get<std::string>() : why.dump());
  }
  for (const json& l : j["leaving"]) {
    if (!l.is_array() || l.size() != 2 || !l[0].is_number_integer() || !l[1].is_string()) {
      return UnavailableError("the capacity query's answer has a malformed 'leaving': " +
                              j["leaving"].dump());
    }
    room.leaving.emplace_back(l[0].get<int>(), l[1].get<std::string>());
  }
  return room;
}

KubernetesLauncher::KubernetesLauncher(KubernetesOptions options, config::ScalingConfig config,
                                       placement::Plan plan)
    : options_(std::move(options)),
      config_(std::move(config)),
      plan_(std::move(plan)),
      capacity_shape_(InternalError("not made")) {
  StatusOr<json> shape = CapacityShape(config_, plan_, options_);
  capacity_shape_ = shape.ok() ? StatusOr<std::string>(shape->dump()) : shape.status();
}

KubernetesLauncher::~KubernetesLauncher() {
  ReleaseKept();
  RemoveRequests();
}

void KubernetesLauncher::EndRun(bool keep) {
  ReleaseKept();
  RemoveRequests();
}

std::vector<std::string> KubernetesLauncher::SupervisorEnvironment() const {
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : CurrentEnvironment()) {
    if (!kSecretEnv.count(k)) env_strings.push_back(k + "=" + v);
  }
  // The supervisor ends the run's objects when this process is gone
  // (python/jaxtrain/kubernetes/supervisor.py).
  env_strings.push_back("JAXTRAIN_DRIVER_PID=" + std::to_string(getpid()));
  return env_strings;
}

void KubernetesLauncher::ReleaseKept() {
  if (request_dir_.empty()) return;
  const std::string kept = request_dir_ + "/" + kKeptFile;
  if (access(kept.c_str(), F_OK) != 0) return;
  std::vector<std::string> argv = options_.supervisor_argv;
  argv.push_back("--release");
  argv.push_back(kept);
  const std::vector<std::string> env_strings = SupervisorEnvironment();
  auto spawned = SpawnWithOutputPipe({.argv = argv, .env = &env_strings, .search_path = true});
  if (!spawned.ok()) {
    Say("kubernetes: cannot delete the JobSet kept for a next attempt (" + kept +
        "): " + spawned.status().message());
  } else {
    // Its lines (errors only) go to the driver's stderr, as the queue's do.
    std::string output;
    char buffer[4096];
    for (;;) {
      ssize_t n = read(spawned->output_fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      output.append(buffer, static_cast<size_t>(n));
    }
    close(spawned->output_fd);
    WaitForExit(spawned->pid);
    std::string_view rest = output;
    while (!rest.empty()) {
      std::string_view line = rest.substr(0, rest.find('\n'));
      rest.remove_prefix(std::min(rest.size(), line.size() + 1));
      if (!line.empty()) SaySupervisorLine(line);
    }
  }
  unlink(kept.c_str());
}

void KubernetesLauncher::RemoveRequest() {
  if (!request_path_.empty()) unlink(request_path_.c_str());
  request_path_.clear();
}

void KubernetesLauncher::RemoveRequests() {
  RemoveRequest();
  if (!request_dir_.empty()) rmdir(request_dir_.c_str());
  request_dir_.clear();
}

StatusOr<std::vector<LaunchedProcess>> KubernetesLauncher::Launch(
    const std::vector<ProcessSpec>& specs) {
  pid_ = 0;
  kills_ = 0;
  queue_wait_s_ = 0;
  if (interrupted_) return CancelledError("the run is being stopped: no JobSet is created");
  const std::string jobset_name = options_.name + "-" + std::to_string(++attempts_);
  JT_ASSIGN_OR_RETURN(json request, JobSetRequest(config_, plan_, options_, jobset_name, specs));

  // The last attempt's request is gone unless its supervisor died before reading it.
  RemoveRequest();
  if (request_dir_.empty()) {
    std::string dir = options_.request_dir + "/jaxtrain-kubernetes-XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) {
      return InternalError("cannot create a directory in '" + options_.request_dir +
                           "': " + std::strerror(errno));
    }
    request_dir_ = dir;
  }
  const std::string path = request_dir_ + "/" + jobset_name + ".json";
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return InternalError("cannot write '" + path + "': " + std::strerror(errno));
  request_path_ = path;
  int err = 0;
  const bool written = WriteAll(fd, request.dump(), "write", &err).ok();
  close(fd);
  if (!written) {
    RemoveRequest();
    return Status(ErrnoCode(err), "cannot write '" + path + "': " + std::strerror(err));
  }

  std::vector<std::string> argv = options_.supervisor_argv;
  argv.push_back(path);
  const std::vector<std::string> env_strings = SupervisorEnvironment();
  auto spawned = SpawnWithOutputPipe(
      {.argv = argv, .env = &env_strings, .process_group = 0, .search_path = true});
  if (!spawned.ok()) {
    RemoveRequest();
    return UnavailableError("cannot start the Kubernetes supervisor '" + argv[0] +
                            "': " + spawned.status().message());
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, spawned->pid, 0));
  if (pidfd < 0) {
    int err = errno;
    kill(spawned->pid, SIGKILL);
    int status = 0;
    while (waitpid(spawned->pid, &status, 0) < 0 && errno == EINTR) {
    }
    close(spawned->output_fd);
    return UnavailableError(std::string("pidfd_open: ") + std::strerror(err));
  }
  pid_ = spawned->pid;
  fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  fcntl(spawned->output_fd, F_SETFL, fcntl(spawned->output_fd, F_GETFL) | O_NONBLOCK);
  if (!options_.queue_name.empty()) {
    const auto queued = std::chrono::steady_clock::now();
    Status admitted = AwaitAdmission(spawned->pid, spawned->output_fd);
    queue_wait_s_ =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count();
    if (!admitted.ok()) {
      close(pidfd);
      close(spawned->output_fd);
      pid_ = 0;
      return admitted;
    }
  }
  std::vector<int> ranks;  // in MergeUniform's order
  for (const auto& spec : specs) ranks.insert(ranks.end(), spec.ranks.begin(), spec.ranks.end());
  return std::vector<LaunchedProcess>{{ranks, spawned->pid, pidfd, spawned->output_fd}};
}

void KubernetesLauncher::Interrupt() { interrupted_ = true; }

// --- elastic runs -------------------------------------------------------------------------------

namespace {

// The rank of a pod slot ("pod-3": 3); -1 for a name that is none.
int SlotRank(const std::string& host) {
  const std::string_view prefix = kPodSlotPrefix;
  if (host.compare(0, prefix.size(), prefix) != 0 || host.size() == prefix.size()) return -1;
  int rank = 0;
  for (char c : host.substr(prefix.size())) {
    if (c < '0' || c > '9' || rank > 1'000'000) return -1;
    rank = rank * 10 + (c - '0');
  }
  return rank;
}

}  // namespace

StatusOr<PodRoom> KubernetesLauncher::AskRoom(int cancel_fd) {
  if (interrupted_.load()) return CancelledError("the run is being stopped");
  JT_ASSIGN_OR_RETURN(const std::string shape, capacity_shape_);
  std::vector<std::string> argv = options_.supervisor_argv;
  argv.push_back("--capacity");
  argv.push_back(shape);
  const std::vector<std::string> env = SupervisorEnvironment();
  StatusOr<std::string> out = RunToEnd({.argv = argv, .env = &env, .search_path = true},
                                       std::chrono::seconds(60), cancel_fd);
  if (out.status().code() == StatusCode::kCancelled) return out.status();
  StatusOr<PodRoom> room = out.ok() ? ParsePodRoom(Trim(*out)) : out.status();
  const int wanted = config_.num_workers();
  std::string said;
  if (!room.ok()) {
    said = "kubernetes: cannot tell how many of the run's pods the cluster has room for (" +
           room.status().message() +
           "); the run takes all of them as there (an elastic run needs to list nodes and pods: "
           "the ClusterRole jaxtrain-cluster of docs/kubernetes-rbac.yaml)";
  } else if (room->room < wanted) {
    said = "kubernetes: the cluster has room for " + std::to_string(room->room) + " of the run's " +
           std::to_string(wanted) + " worker pods" +
           (room->why.empty() ? "" : " (" + room->why + ")");
  } else {
    said = "kubernetes: the cluster has room for all " + std::to_string(wanted) +
           " of the run's worker pods";
  }
  {
    MutexLock lock(room_mu_);
    // Said when it changes; the first answer only when it is not all of them.
    const bool first_and_full = said_room_.empty() && room.ok() && room->room >= wanted;
    if (said != said_room_ && !first_and_full) Say(said);
    said_room_ = said;
  }
  return room;
}

StatusOr<std::vector<std::string>> KubernetesLauncher::UnreachableHosts(
    const std::vector<std::string>& hosts, Duration wait, int cancel_fd) {
  auto probe = [&]() -> StatusOr<std::vector<std::string>> {
    StatusOr<PodRoom> room = AskRoom(cancel_fd);
    if (room.status().code() == StatusCode::kCancelled) return room.status();
    std::vector<std::string> down;
    if (!room.ok()) return down;  // said; every slot taken as there
    for (const std::string& host : hosts) {
      if (SlotRank(host) >= room->room) down.push_back(host);
    }
    return down;
  };
  return ProbeUntil(probe, wait, cancel_fd, interrupted_);
}

StatusOr<std::vector<std::string>> KubernetesLauncher::LeavingHosts(
    const std::vector<std::string>& hosts, int cancel_fd) {
  StatusOr<PodRoom> room = AskRoom(cancel_fd);
  if (room.status().code() == StatusCode::kCancelled) return room.status();
  if (!room.ok()) return std::vector<std::string>{};
  // The pods are alike: as many slots leave as the run has pods on cordoned nodes, the last ones.
  size_t leaving = 0;
  for (const auto& [rank, node] : room->leaving) {
    const std::string slot = kPodSlotPrefix + std::to_string(rank);
    if (std::find(hosts.begin(), hosts.end(), slot) == hosts.end()) continue;
    Say("kubernetes: node " + node + ", where rank " + std::to_string(rank) +
        "'s pod trains, is cordoned");
    ++leaving;
  }
  return std::vector<std::string>(
      hosts.end() - static_cast<ptrdiff_t>(std::min(leaving, hosts.size())), hosts.end());
}

Status KubernetesLauncher::UsePlan(const placement::Plan& plan) {
  if (plan.workers.empty()) return InvalidArgumentError("the plan has no rank");
  if (config_.use_tpu() && config_.tpu_slice() &&
      plan.workers.size() % static_cast<size_t>(config_.workers_per_slice()) != 0) {
    return InvalidArgumentError("the plan's " + std::to_string(plan.workers.size()) +
                                " ranks are not whole TPU slices of " +
                                std::to_string(config_.workers_per_slice()));
  }
  plan_ = plan;
  return OkStatus();
}

Status KubernetesLauncher::PrepareNext(const std::vector<ProcessSpec>& specs) {
  if (pid_ > 0 && kill(pid_, SIGUSR2) != 0 && errno != ESRCH) {
    return UnavailableError(std::string("cannot ask the Kubernetes supervisor for standbys: ") +
                            std::strerror(errno));
  }
  return OkStatus();
}

Status KubernetesLauncher::AwaitAdmission(pid_t pid, int output_fd) {
  std::string line;
  bool told = false;
  for (;;) {
    if (interrupted_ && !told) {
      kill(pid, SIGUSR1);  // the JobSet deleted at once; the supervisor then ends
      told = true;
    }
    pollfd pfd{output_fd, POLLIN, 0};
    if (poll(&pfd, 1, 200) < 0 && errno != EINTR) break;
    char c;
    ssize_t n = read(output_fd, &c, 1);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) break;  // the supervisor ended before its JobSet was admitted
    if (c != '\n') {
      line.push_back(c);
      continue;
    }
    SaySupervisorLine(line);
    if (std::string_view(line).substr(0, kAdmittedLine.size()) == kAdmittedLine) break;
    line.clear();
  }
  if (!told) return OkStatus();  // an early end is the controller's to read, as any other
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return CancelledError("the run is being stopped: its JobSet was deleted while queued in Kueue");
}

Status KubernetesLauncher::SignalGroup(int signal) {
  if (pid_ <= 0) return OkStatus();
  int sent = 0;
  if (signal == SIGTERM) {
    sent = SIGTERM;
  } else if (signal == SIGKILL) {
    // The first SIGKILL asks for deletion without grace; the supervisor must still see the pods
    // gone before it exits, so that no attempt overlaps the next one.
    sent = ++kills_ == 1 ? SIGUSR1 : SIGKILL;
  }
  if (sent == 0 || kill(pid_, sent) == 0 || errno == ESRCH) return OkStatus();
  return UnavailableError("cannot send " + SignalName(sent) + " to the supervisor (pid " +
                          std::to_string(pid_) + "): " + std::strerror(errno));
}

}  // namespace jaxtrain::launch
