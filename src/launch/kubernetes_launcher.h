// KubernetesLauncher: the worker group as one JobSet. Launch() writes the attempt's JobSet (and
// the Secret holding the run's key) into a request file and starts one supervisor process,
// `python -m jaxtrain.kubernetes supervise FILE` (python/jaxtrain/kubernetes/supervisor.py), which
// talks to the API server with the official Kubernetes client: it creates the objects, watches the
// pods, streams their logs labelled "<rank>: " (not for a single rank), says how each rank ended in
// a line ParseTaskEnd() reads, and deletes the JobSet — waiting until its pods are gone — when a
// pod fails, when every pod has succeeded, or when it is signalled. The one LaunchedProcess
// carries every rank, as a Slurm step does; its exit is the group's end.
//
// What is asked of Kubernetes (JobSetManifest, docs/kubernetes.md): one pod per rank, in one
// replicatedJob whose Jobs are the TPU slices (replicas = slices, pods per Job = hosts per slice)
// or one Job for GPU and CPU workers; Indexed Jobs, backoffLimit 0, restartPolicy Never and
// JobSet's maxRestarts 0 (jaxtrain restarts the group itself, from its checkpoint). Each pod
// derives its rank from its Job's index and its completion index (python/jaxtrain/worker/entry.py).
// TPU: google.com/tpu limits of a host's chips, the GKE node selectors for the accelerator and
// the topology, and JobSet's exclusive-topology annotation so that a slice is placed whole on one
// node pool or not at all; several slices also get the MEGASCALE variables. GPU: nvidia.com/gpu
// limits. The run's key reaches the pods only as a file of a Secret volume (0400, or 0440 with the
// template's fsGroup for a worker that is not root); the worker environment's values other than
// jaxtrain's own JAXTRAIN_* settings (worker_runtime_env's env_vars, what placement sets) are keys
// of the same Secret, which the pod spec names but does not hold. Worker pods get no service
// account token unless the template asks for one (automountServiceAccountToken).
//
// Restarts in place (docs/kubernetes.md): when the worker command is the pod holder's
// (`python -m jaxtrain.kubernetes hold -- ...`, python/jaxtrain/kubernetes/pod.py), a supervisor
// whose attempt failed or was stopped with every pod still there stops the workers through their
// holders instead of deleting the JobSet, and leaves it in its request directory's kept.json; the
// next Launch()'s supervisor takes it over and starts that attempt's workers in the same pods (from
// their standbys), or deletes it and makes a new JobSet when it cannot. EndRun() deletes a JobSet
// still kept. The launcher itself only passes the directory: what is kept is the supervisors'.
//
// Request files: Launch() makes one 0700 directory under KubernetesOptions::request_dir
// (mkdtemp) and one 0600 file in it per attempt, which the supervisor deletes once read. A file
// its supervisor never read is deleted at the next Launch(); the file and the directory at
// EndRun() or when the launcher is destroyed. Only a driver killed hard leaves them behind.
//
// Kueue: with KubernetesOptions::queue_name the JobSet carries Kueue's queue-name (and priority
// class) label and is created suspended. The supervisor says "queued" while Kueue has not admitted
// it, and Launch() waits for its "admitted" line (a queue is a wait, like a Slurm allocation's, not
// a start-up that can time out), saying the supervisor's queue lines on the driver's stderr. A
// Kueue eviction suspends the JobSet, whose pods are deleted: their SIGTERM is the workers'
// preemption notice (docs/preemption.md), and the next attempt's JobSet is queued again.
//
// Elastic runs (docs/elastic.md): the hosts an elastic run resizes by are its pods, one rank each,
// named kPodSlotPrefix + rank ("pod-0", "pod-1", ...), and for TPUs its slices (every pod of one:
// one Job of the JobSet). Which of them can be had is the room the cluster has for the run's pods
// (`supervisor_argv --capacity SHAPE`, python/jaxtrain/kubernetes/capacity.py): nodes Ready, not
// cordoned, matching the pods' nodeSelector, without a taint they do not tolerate, and with the
// pods' requests free; for TPU slices, whole slices, one per node pool (JobSet's exclusive
// placement). A pod of the run on a node being cordoned is a host the cluster takes from the run
// (LeavingHosts).
//
// Thread-safety: used by the controller's event loop only, except Interrupt(), UnreachableHosts()
// and LeavingHosts() (the capacity monitor's thread). JobSetManifest is a pure function.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "accelerators/discovery.h"
#include "accelerators/tpu.h"
#include "base/mutex.h"
#include "base/status.h"
#include "config/scaling_config.h"
#include "launch/launcher.h"
#include "placement/plan.h"

namespace jaxtrain::launch {

// What the Python layer decides for a Kubernetes run (python/jaxtrain/kubernetes/launch.py), as
// JSON.
struct KubernetesOptions {
  std::string namespace_name;
  std::string name;  // the run's objects are "<name>-<n>" for the n-th attempt of this driver
  std::string image;
  std::string image_pull_policy;              // empty: Kubernetes' default
  std::string service_account;                // empty: the namespace's default
  std::vector<std::string> worker_command;    // the command of every worker container
  std::vector<std::string> supervisor_argv;   // the supervisor, run on this host
  std::string request_dir;                    // where the launcher makes its request directory
  double pending_timeout_s = 300;             // a pod that cannot be scheduled this long fails
  nlohmann::json pod_template;                // merged into every worker pod; null: none
  nlohmann::json owner;                       // ownerReference of the run's objects; null: none
  std::map<std::string, std::string> labels;  // added to every object and pod
  // Kueue (docs/kubernetes.md): the LocalQueue the JobSet is submitted to (its
  // kueue.x-k8s.io/queue-name label; the JobSet is created suspended, for Kueue to admit), and its
  // WorkloadPriorityClass (kueue.x-k8s.io/priority-class). Empty: none.
  std::string queue_name;
  std::string priority_class;

  // Errors: kInvalidArgument naming the missing or malformed field (queue_name and
  // priority_class must be DNS subdomain names of at most 63 characters: label values that name
  // an object).
  static StatusOr<KubernetesOptions> FromJson(const nlohmann::json& json);
};

// GKE's node label value (cloud.google.com/gke-tpu-accelerator) for a TPU generation.
// Errors: kInvalidArgument for a generation GKE does not offer (the message lists those it does).
StatusOr<std::string> GkeTpuAccelerator(accelerators::TpuGeneration generation);

// The plan of a Kubernetes run (placement::PlanForScheduler): one environment for every rank,
// except for a simulated TPU config, whose ranks get what a local simulated worker gets.
// Errors: kInvalidArgument when the ScalingConfig asks for what one pod per worker cannot give:
// a TPU generation GKE does not offer, several workers per TPU host, a fractional GPU count.
StatusOr<placement::Plan> PlanForKubernetes(const config::ScalingConfig& config,
                                            const accelerators::HostView& env);

// The prefix of a worker environment variable's key in the attempt's Secret.
inline constexpr char kSecretEnvPrefix[] = "env.";

// What of the workers' environment `env` the attempt's Secret holds: every variable but
// jaxtrain's own (JAXTRAIN_*), under kSecretEnvPrefix + name.
std::map<std::string, std::string> SecretEnv(const std::map<std::string, std::string>& env);

// The JobSet of one attempt, named `jobset_name`, whose containers run `command` with `env` (and
// the per-pod variables). The Secret `jobset_name` holds the run's key under "secret" and the
// variables of SecretEnv(env), which the containers read from it (secretKeyRef).
// Errors: kInvalidArgument as PlanForKubernetes, for a pod template that is not a Pod-shaped
// object ({"metadata": {...}, "spec": {...}}), for one that runs the worker as a user other than
// root without spec.securityContext.fsGroup (the key's file would be unreadable), or for a
// variable whose name cannot be a Secret key.
StatusOr<nlohmann::json> JobSetManifest(const config::ScalingConfig& config,
                                        const placement::Plan& plan,
                                        const KubernetesOptions& options,
                                        const std::string& jobset_name,
                                        const std::map<std::string, std::string>& env);

// The request Launch() writes for one attempt (a pure function of its arguments): the JobSet
// named `jobset_name` (JobSetManifest) with the environment the specs share, the Secret (its name,
// the run's key, the variables of SecretEnv), the number of ranks and the supervisor's settings.
// What placement gives each rank of its own (placement::kPerRankPlacementVariables: a simulated
// TPU worker's TPU_WORKER_ID, ...) is passed in JAXTRAIN_RANK_ENV (MergeUniform). A real TPU
// plan has none of them: GKE sets TPU_WORKER_ID and TPU_WORKER_HOSTNAMES in the pods itself, and
// JobSetManifest the MEGASCALE variables of several slices.
// Errors: kInvalidArgument as MergeUniform and JobSetManifest; kInternal when the specs carry no
// run key.
StatusOr<nlohmann::json> JobSetRequest(const config::ScalingConfig& config,
                                       const placement::Plan& plan,
                                       const KubernetesOptions& options,
                                       const std::string& jobset_name,
                                       const std::vector<ProcessSpec>& specs);

// The supervisor's line for a rank's end: "jaxtrain kubernetes: rank 1 on node-7: exited with
// status 3" (or "killed by signal 9", or another reason such as "deleted (node lost)", read as a
// SIGKILL). nullopt for any other line.
std::optional<TaskEnd> ParseKubernetesTaskEnd(std::string_view line);

// The host name of an elastic run's pod of rank `rank` ("pod-1").
inline constexpr char kPodSlotPrefix[] = "pod-";

// An elastic run's plan on Kubernetes for `workers` of `config`'s ranks: PlanForKubernetes of that
// many workers (a simulated TPU's environment made for that many slices), each rank on the pod
// slot of its rank and, for TPU slices, in the slice "slice-<n>" of its Job.
// Errors: kInvalidArgument as PlanForKubernetes, or for a number of workers that is not whole
// slices.
StatusOr<placement::Plan> PlanOnPodSlots(const config::ScalingConfig& config,
                                         const accelerators::HostView& env, int workers);

// What the capacity query is asked about (python/jaxtrain/kubernetes/capacity.py): the run's label
// value ("run"), one worker pod's spec ("pod", as JobSetManifest makes it), the pods per Job, and
// for TPU slices the pods of a slice ("slice_pods") and the node label of its placement domain
// ("slice_domain", the GKE node pool).
// Errors: as JobSetManifest.
StatusOr<nlohmann::json> CapacityShape(const config::ScalingConfig& config,
                                       const placement::Plan& plan,
                                       const KubernetesOptions& options);

// The capacity query's answer.
struct PodRoom {
  int room = 0;                                      // pods of the run the cluster has room for
  std::vector<std::pair<int, std::string>> leaving;  // (rank, node) of its pods on a cordoned node
  std::string why;                                   // "node2: cordoned; ...": nodes with no room
};

// Parses the capacity query's JSON line. Errors: kUnavailable with the query's own error, or
// naming what is malformed.
StatusOr<PodRoom> ParsePodRoom(std::string_view output);

class KubernetesLauncher : public Launcher {
 public:
  KubernetesLauncher(KubernetesOptions options, config::ScalingConfig config, placement::Plan plan);
  ~KubernetesLauncher() override;

  // Writes the attempt's request (0600; the supervisor deletes it once read) and starts the
  // supervisor in a new process group.
  // Errors: kInvalidArgument when the specs differ in their command or in an environment
  // variable other than the per-rank ones, or as JobSetManifest; kInternal when the request
  // cannot be written; kUnavailable when the supervisor cannot be started.
  StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) override;

  // SIGTERM: the supervisor deletes the JobSet with the pods' grace period and waits for them to
  // be gone. SIGKILL: the same at once (grace period 0), then the supervisor itself is killed if
  // it is still there at the next SIGKILL. Other signals are not forwarded.
  Status SignalGroup(int signal) override;

  std::optional<TaskEnd> ParseTaskEnd(std::string_view line) const override {
    return ParseKubernetesTaskEnd(line);
  }

  // The attempt trains: the supervisor asks each pod's holder to start its standby worker (restarts
  // in place; SIGUSR2, which a supervisor without holders ignores).
  Status PrepareNext(const std::vector<ProcessSpec>& specs) override;

  // Deletes the JobSet the last attempt kept for a next one (restarts in place), waiting for its
  // pods to be gone, then the request directory and any request left in it.
  void EndRun(bool keep) override;

  // A Launch() waiting for Kueue's admission ends with kCancelled, its JobSet deleted.
  void Interrupt() override;

  // Elastic runs (hosts are pod slots, PlanOnPodSlots): the slots beyond the room the cluster has
  // for the run's pods, asked again with backoff for up to `wait`; a query that cannot be made is
  // said once and takes every slot as there.
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration wait, int cancel_fd) override;
  // The slots of `hosts` whose pods are on nodes being cordoned.
  StatusOr<std::vector<std::string>> LeavingHosts(const std::vector<std::string>& hosts,
                                                  int cancel_fd) override;
  // The next JobSet has the plan's ranks (PlanOnPodSlots; whole slices for TPUs).
  // Errors: kInvalidArgument for a plan with no rank, or not of whole slices.
  Status UsePlan(const placement::Plan& plan) override;

  // The last Launch()'s wait for Kueue's admission: from the supervisor's start to its
  // "admitted" line (or its end); 0 without a queue.
  double QueueWait() const override { return queue_wait_s_; }
  bool MayQueue() const override { return !options_.queue_name.empty(); }

 private:
  void RemoveRequest();   // the last Launch()'s request file, if still there
  void RemoveRequests();  // and the directory
  // Deletes the JobSet a supervisor kept (kept.json in the request directory), through
  // `supervisor_argv --release FILE`, and waits for it; says any error on the driver's stderr.
  void ReleaseKept();
  // The supervisor's environment: the driver's without the run's secret, and the driver's pid.
  std::vector<std::string> SupervisorEnvironment() const;
  // Reads the supervisor's output, a byte at a time (nothing past it is taken from the
  // controller), until it says its JobSet is admitted or its output ends, saying each line.
  // Errors: kCancelled after Interrupt(), the supervisor told to delete the JobSet and reaped.
  Status AwaitAdmission(pid_t pid, int output_fd);
  // Asks the cluster for the room it has for the run's pods (capacity.py); says on the driver's
  // stderr when the answer changes. Errors: kCancelled; kUnavailable when it cannot be asked.
  StatusOr<PodRoom> AskRoom(int cancel_fd);

  KubernetesOptions options_;
  config::ScalingConfig config_;
  placement::Plan plan_;
  pid_t pid_ = 0;  // the supervisor of the last Launch(); 0 when none
  int kills_ = 0;  // SIGKILLs asked for since the last Launch()
  int attempts_ = 0;
  double queue_wait_s_ = 0;  // of the last Launch()
  std::atomic<bool> interrupted_{false};
  std::string request_dir_;   // made by the first Launch(); "" when none
  std::string request_path_;  // the last Launch()'s request file; "" when none
  // The capacity query's shape (CapacityShape), made once; and what the last answers said.
  StatusOr<std::string> capacity_shape_;
  Mutex room_mu_;
  std::string said_room_ GUARDED_BY(room_mu_);
};

}  // namespace jaxtrain::launch
