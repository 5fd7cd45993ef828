// jaxtrain._core: the Python face of the C++ engine. This is the only place where a Status
// becomes a Python exception, and every call that can block releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "accelerators/discovery.h"
#include "accelerators/tpu.h"
#include "config/run_config.h"
#include "config/scaling_config.h"
#include "controller/controller.h"
#include "launch/choose.h"
#include "launch/kubernetes_launcher.h"
#include "launch/local_launcher.h"
#include "launch/slurm_launcher.h"
#include "launch/ssh_launcher.h"
#include "launch/standby_pool.h"
#include "placement/elastic.h"
#include "placement/plan.h"
#include "storage/checkpoint.h"
#include "storage/crc32c.h"
#include "storage/run_store.h"
#include "storage/sha256.h"
#include "wire/channel.h"
#include "wire/handshake.h"
#include "worker/worker_client.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jaxtrain {
namespace {

[[noreturn]] void Raise(const Status& s) {
  PyObject* type = PyExc_RuntimeError;
  switch (s.code()) {
    case StatusCode::kInvalidArgument: type = PyExc_ValueError; break;
    case StatusCode::kPermissionDenied:
    case StatusCode::kUnauthenticated: type = PyExc_PermissionError; break;
    case StatusCode::kNotFound: type = PyExc_FileNotFoundError; break;
    case StatusCode::kUnavailable: type = PyExc_ConnectionError; break;
    case StatusCode::kDeadlineExceeded: type = PyExc_TimeoutError; break;
    default: break;
  }
  PyErr_SetString(type, s.message().c_str());
  throw nb::python_error();
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Unwrap(StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return std::move(v).value();
}

Duration Seconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

// A channel's malformed message (kDataLoss) is a connection error to its callers, as every other
// failure of the connection is: Python's ConnectionError.
Status ChannelError(Status s) {
  if (s.code() == StatusCode::kDataLoss) return UnavailableError(s.message());
  return s;
}

template <typename T>
StatusOr<T> ChannelError(StatusOr<T> v) {
  if (!v.ok()) return ChannelError(v.status());
  return v;
}

// A channel's timeout; None: none (ten years).
Duration ChannelTimeout(std::optional<double> seconds) {
  return Seconds(seconds.value_or(10.0 * 365 * 24 * 3600));
}

nb::dict PlanToDict(const placement::Plan& plan) {
  nb::list workers;
  for (const auto& w : plan.workers) {
    nb::dict d;
    d["rank"] = w.rank;
    d["local_rank"] = w.local_rank;
    d["local_world_size"] = w.local_world_size;
    d["node_rank"] = w.node_rank;
    d["host"] = w.host;
    d["address"] = w.address;
    d["slice"] = w.slice.empty() ? nb::object(nb::none()) : nb::object(nb::str(w.slice.c_str()));
    d["devices"] = w.devices;
    d["env"] = w.env;
    d["unset_env"] = w.unset_env;
    workers.append(d);
  }
  nb::dict out;
  out["platform"] = plan.platform;
  out["accelerator"] = plan.accelerator;
  out["simulated"] = plan.simulated;
  out["hosts_source"] = plan.hosts_source;
  out["num_slices"] = plan.num_slices;
  out["workers"] = workers;
  return out;
}

nb::dict FailureToDict(const controller::RankFailure& f) {
  nb::dict d;
  d["rank"] = f.rank;
  d["host"] = f.host;
  d["attempt"] = f.attempt;
  d["cause"] = controller::FailureCauseName(f.cause);
  d["exit_code"] = f.exit_code >= 0 ? nb::object(nb::int_(f.exit_code)) : nb::none();
  d["signal"] = f.signal != 0 ? nb::object(nb::int_(f.signal)) : nb::none();
  d["status_code"] = f.status_code != StatusCode::kOk
                         ? nb::object(nb::str(std::string(StatusCodeName(f.status_code)).c_str()))
                         : nb::none();
  d["retried"] = f.retried;
  d["decision"] = f.decision;
  d["message"] = f.message;
  d["traceback"] = f.traceback;
  d["log_path"] = f.log_path;
  d["log_tail"] = f.log_tail;
  d["preemption"] =
      f.preemption.is_null() ? nb::none() : nb::object(nb::str(f.preemption.dump().c_str()));
  return d;
}

// What fit() gives the controller (python/jaxtrain/driver/trainer.py), by name:
// Controller(**options), each option a field of ControllerOptions. A new option is a field here,
// its line in the binding of ControllerOptions, and where PyController hands it on.
struct PyControllerOptions {
  std::string run_dir;
  std::string experiment_name;
  placement::Plan plan;
  std::vector<std::string> worker_argv;
  std::string worker_cwd;
  std::map<std::string, std::string> worker_env;
  nb::bytes payload = nb::bytes("", 0);
  std::string run_config_json;
  double terminate_grace_s = 0;
  double start_timeout_s = 0;
  // The automatic progress limit's floor (JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S); 0: the default.
  double progress_timeout_floor_s = 0;
  std::optional<config::FailureConfig> failure_config;
  std::optional<config::CheckpointConfig> checkpoint_config;
  bool verify_checksums = true;
  int console_fd = -1;
  std::string launcher = "local";
  std::optional<config::ScalingConfig> scaling_config;
  bool status_line = false;
  std::string launcher_options_json;
  std::string memory_store;
  bool verbose = false;
};
// The options Controller() must be given.
constexpr const char* kRequiredControllerOptions[] = {
    "run_dir",           "experiment_name", "plan",           "worker_argv",
    "worker_cwd",        "worker_env",      "payload",        "run_config_json",
    "terminate_grace_s", "start_timeout_s", "failure_config", "checkpoint_config",
    "verify_checksums",  "console_fd"};

class PyController {
 public:
  explicit PyController(PyControllerOptions a)
      : kind_(Unwrap(launch::ParseLauncherKind(a.launcher, "Controller() option 'launcher'"))),
        scaling_config_(std::move(a.scaling_config)),
        host_wait_(Seconds(a.failure_config->unreachable_host_timeout_s())) {
    controller::ControllerOptions& o = options_;
    o.run_dir = std::move(a.run_dir);
    o.experiment_name = std::move(a.experiment_name);
    o.plan = a.plan;
    o.worker_argv = std::move(a.worker_argv);
    o.worker_cwd = std::move(a.worker_cwd);
    o.worker_env = std::move(a.worker_env);
    o.payload = std::string(a.payload.c_str(), a.payload.size());
    o.run_config = nlohmann::json::parse(a.run_config_json, nullptr, false);
    o.terminate_grace = Seconds(a.terminate_grace_s);
    o.start_timeout = Seconds(a.start_timeout_s);
    const config::FailureConfig& failure_config = *a.failure_config;
    o.progress_timeout = Seconds(failure_config.progress_timeout_s().value_or(0));
    if (failure_config.progress_timeout_auto()) {
      o.progress_auto = controller::AutoLimit{};
      if (a.progress_timeout_floor_s > 0) {
        o.progress_auto->floor = Seconds(a.progress_timeout_floor_s);
      }
    }
    o.max_failures = failure_config.max_failures();
    o.max_start_failures = failure_config.controller_failure_limit();
    o.max_preemptions = failure_config.max_preemption_failures();
    o.preemption_grace = Seconds(failure_config.preemption_grace_s());
    const auto& cc = a.checkpoint_config->input();
    o.retention = {.num_to_keep = cc.num_to_keep,
                   .score_attribute = cc.checkpoint_score_attribute,
                   .higher_is_better = a.checkpoint_config->higher_is_better()};
    o.verify_checksums = a.verify_checksums;
    o.verbose = a.verbose;
    o.memory_store = std::move(a.memory_store);
    o.status_line = a.status_line;
    o.console_fd = a.console_fd;
    if (kind_ != launch::LauncherKind::kLocal && !scaling_config_) {
      PyErr_Format(PyExc_ValueError, "the %s launcher needs the option 'scaling_config'",
                   std::string(launch::LauncherKindName(kind_)).c_str());
      throw nb::python_error();
    }
    if (kind_ == launch::LauncherKind::kLocal) {
      // Warm workers (docs/warm-workers.md) unless JAXTRAIN_WARM_WORKERS=0; refused here, before
      // anything starts, when it is neither.
      const bool warm = Unwrap(launch::WarmWorkersRequested());
      controller_ = std::make_unique<controller::Controller>(
          std::move(o),
          std::make_unique<launch::LocalLauncher>(warm ? &launch::StandbyPool::Driver() : nullptr));
    } else if (kind_ == launch::LauncherKind::kKubernetes) {
      // The workers run in pods: the command of the image, the listen address the Python layer
      // chose (one the pods reach), no working directory of this host.
      auto json = nlohmann::json::parse(a.launcher_options_json, nullptr, false);
      launch::KubernetesOptions k = Unwrap(launch::KubernetesOptions::FromJson(json));
      if (json.contains("listen_host") && json["listen_host"].is_string()) {
        o.listen_host = json["listen_host"].get<std::string>();
      }
      o.worker_argv = k.worker_command;
      o.worker_cwd.clear();
      if (scaling_config_->elastic()) {
        // Pods, one rank each (TPU slices: whole Jobs of them), as the hosts it resizes by
        // (docs/elastic.md), with the deadline of an ssh run's unreachable host for a pod the
        // cluster has no room for. The pods are alike: the slots chosen are always the first
        // ones (the launcher names the last slots as those it has no room for, or that leave).
        const config::ScalingConfig config = *scaling_config_;
        o.plan =
            Unwrap(launch::PlanOnPodSlots(config, accelerators::RealHost(), config.num_workers()));
        o.elastic = Elastic([config](const std::vector<std::string>&, int workers) {
          return launch::PlanOnPodSlots(config, accelerators::RealHost(), workers);
        });
      }
      placement::Plan plan = o.plan;
      controller_ = std::make_unique<controller::Controller>(
          std::move(o),
          std::make_unique<launch::KubernetesLauncher>(std::move(k), *scaling_config_, plan));
    }  // ssh and Slurm: made by Start(), which waits for hosts or an allocation
  }

  // Controller(**options): each keyword sets the field of ControllerOptions of its name, with
  // that field's type check; an unknown or missing option is a TypeError naming it.
  static void Init(PyController* self, nb::kwargs kwargs) {
    nb::object options = nb::cast(PyControllerOptions());
    nb::handle type = nb::type<PyControllerOptions>();
    for (auto [name, value] : kwargs) {
      nb::object field = nb::getattr(type, name, nb::none());
      if (PyObject_IsInstance(field.ptr(), reinterpret_cast<PyObject*>(&PyProperty_Type)) != 1) {
        PyErr_Format(PyExc_TypeError,
                     "Controller() got an unknown option '%U'; the options are the fields of "
                     "jaxtrain._core.ControllerOptions",
                     name.ptr());
        throw nb::python_error();
      }
      try {
        nb::setattr(options, name, value);
      } catch (nb::python_error& e) {
        if (!e.matches(PyExc_TypeError)) throw;
        PyErr_Format(PyExc_TypeError,
                     "Controller() option '%U' does not take %R (%R); its type is that of the "
                     "field of jaxtrain._core.ControllerOptions",
                     name.ptr(), value.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(value.ptr())));
        throw nb::python_error();
      }
    }
    for (const char* name : kRequiredControllerOptions) {
      if (!kwargs.contains(name)) {
        PyErr_Format(PyExc_TypeError, "Controller() is missing the option '%s'", name);
        throw nb::python_error();
      }
    }
    PyControllerOptions given = nb::cast<PyControllerOptions>(options);
    for (const auto& [name, set] : {std::pair{"failure_config", given.failure_config.has_value()},
                                    {"checkpoint_config", given.checkpoint_config.has_value()}}) {
      if (!set) {
        PyErr_Format(PyExc_TypeError, "Controller() option '%s' is None", name);
        throw nb::python_error();
      }
    }
    new (self) PyController(std::move(given));
  }

  void Start() {
    if (!controller_ && kind_ == launch::LauncherKind::kSsh) {
      StartOnSsh();
    } else if (!controller_ && kind_ == launch::LauncherKind::kSlurm) {
      StartOnSlurm();
    }
    Status s;
    {
      nb::gil_scoped_release release;
      s = controller_->Start();
    }
    Check(s);
  }

  bool Wait(double timeout_s) {
    if (!controller_) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not been started");
      throw nb::python_error();
    }
    nb::gil_scoped_release release;
    return controller_->Wait(Seconds(timeout_s));
  }

  uint64_t WaitForCommits(uint64_t seen, double timeout_s) {
    if (!controller_) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not been started");
      throw nb::python_error();
    }
    nb::gil_scoped_release release;
    return controller_->WaitForCommits(seen, Seconds(timeout_s));
  }

  void Abort(std::string reason) {
    if (controller_) controller_->Abort(std::move(reason));
  }

  // The folder every rank's stacks were written to now (Controller::TakeStacks()).
  std::string TakeStacks(double timeout_s) {
    if (!controller_) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not been started, or is closed");
      throw nb::python_error();
    }
    StatusOr<std::string> dir = InternalError("");
    {
      nb::gil_scoped_release release;
      dir = controller_->TakeStacks(Seconds(timeout_s));
    }
    return Unwrap(std::move(dir));
  }

  // The folder every rank's trace of its next `steps` steps goes to (Controller::StartProfile()).
  std::string StartProfile(int steps, double timeout_s) {
    if (!controller_) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not been started, or is closed");
      throw nb::python_error();
    }
    StatusOr<std::string> dir = InternalError("");
    {
      nb::gil_scoped_release release;
      dir = controller_->StartProfile(steps, Seconds(timeout_s));
    }
    return Unwrap(std::move(dir));
  }

  // Destroys the controller once the run has ended: a Slurm allocation it requested is released
  // now, not whenever Python collects this object.
  void Close() {
    nb::gil_scoped_release release;
    controller_.reset();
  }

  // The run's metrics as JSON (controller/run_metrics.h); "" before the controller is made.
  std::string MetricsJson() {
    return controller_ ? controller::RunMetricsJson(controller_->metrics()) : "";
  }

  nb::dict Outcome() {
    if (!controller_) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not been started, or is closed");
      throw nb::python_error();
    }
    if (!controller_->Wait(Duration::zero())) {
      PyErr_SetString(PyExc_RuntimeError, "the run has not ended yet");
      throw nb::python_error();
    }
    const auto& o = controller_->outcome();
    nb::dict d;
    d["state"] = std::string(controller::OutcomeStateName(o.state));
    d["failure"] = o.failure ? nb::object(FailureToDict(*o.failure)) : nb::none();
    nb::list failures;
    for (const auto& f : o.failures) failures.append(FailureToDict(f));
    d["failures"] = failures;
    d["attempts"] = o.attempts;
    d["rounds"] = o.rounds;
    d["last_metrics_json"] = o.last_metrics_json;
    d["warnings"] = o.warnings;
    d["abort_reason"] = o.abort_reason;
    // The run directory's records as the run left them (python/jaxtrain/result.py reads no file
    // for them): run.json as JSON text, and rank 0's pickled return value.
    const std::string run_state = o.run_state.is_null() ? "" : o.run_state.dump();
    d["run_state"] =
        run_state.empty() ? nb::none() : nb::object(nb::str(run_state.data(), run_state.size()));
    d["return_value"] = o.return_value
                            ? nb::object(nb::bytes(o.return_value->data(), o.return_value->size()))
                            : nb::none();
    return d;
  }

 private:
  // The Slurm launcher (launch::StartSlurm), waiting for an allocation without the GIL; Ctrl-C
  // withdraws the request. Then the controller is made as for local runs.
  void StartOnSlurm() {
    StatusOr<launch::SlurmStart> started = AbortedError("");
    const auto asked = std::chrono::steady_clock::now();
    {
      nb::gil_scoped_release release;
      started = launch::StartSlurm(*scaling_config_, accelerators::RealHost(),
                                   "jaxtrain-" + options_.experiment_name, [] {
                                     nb::gil_scoped_acquire acquire;
                                     return PyErr_CheckSignals() != 0;  // KeyboardInterrupt pending
                                   });
    }
    if (PyErr_Occurred()) throw nb::python_error();
    launch::SlurmStart start = Unwrap(std::move(started));
    options_.listen_host = std::move(start.listen_host);
    if (scaling_config_->elastic()) {
      // Whole nodes of the allocation (docs/elastic.md): the full plan on its nodes, and each
      // attempt's on those usable, with the deadline of an ssh run's unreachable host.
      options_.plan = Unwrap(launch::PlanForSlurmNodes(*scaling_config_, options_.plan, start.nodes,
                                                       start.shape, start.job_id));
      options_.elastic =
          Elastic([full = options_.plan](const std::vector<std::string>& hosts, int workers) {
            return placement::PlanPerHost(full, hosts, full.workers.front().local_world_size,
                                          workers, full.hosts_source);
          });
    }
    // Asking for the allocation and waiting in Slurm's queue: goodput's queue part.
    options_.queue_wait_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
    controller_ =
        std::make_unique<controller::Controller>(std::move(options_), std::move(start.launcher));
  }

  // The address the hosts reach the controller at (its address on the route to the first host
  // that is not this one, as ~/.ssh/config names it), and the ssh launcher with each rank's host.
  // Blocks for one `ssh -G` per rank until a host other than this one is found.
  void StartOnSsh() {
    const accelerators::HostView& env = accelerators::RealHost();
    // Standby workers on the hosts for a restart unless JAXTRAIN_WARM_WORKERS=0.
    launch::SshLauncherOptions lo{.ssh = launch::SshCommand(env),
                                  .host_wait = host_wait_,
                                  .warm = Unwrap(launch::WarmWorkersRequested())};
    for (const auto& w : options_.plan.workers) lo.targets.push_back(w.host);
    std::string host = env.GetEnv(launch::kListenHostEnv).value_or("");
    if (host.empty()) {
      StatusOr<std::string> chosen = UnavailableError("");
      {
        nb::gil_scoped_release release;
        chosen = launch::ListenHostForSsh(lo.ssh, lo.targets);
      }
      host = Unwrap(std::move(chosen));
    }
    options_.listen_host = host;
    if (scaling_config_->elastic()) {
      options_.elastic =
          Elastic([config = *scaling_config_](const std::vector<std::string>& hosts, int workers) {
            return launch::PlanForSshOn(config, accelerators::RealHost(),
                                        launch::ElasticShare{.hosts = hosts, .workers = workers});
          });
    }
    controller_ = std::make_unique<controller::Controller>(
        std::move(options_), std::make_unique<launch::SshLauncher>(std::move(lo)));
  }

  // An elastic run's options (docs/elastic.md), the same on every launcher but for `plan_on`: a
  // host lost is waited for as long as growing back would take at most.
  controller::ElasticOptions Elastic(decltype(controller::ElasticOptions::plan_on) plan_on) const {
    const Duration interval = Seconds(scaling_config_->resize_monitor_interval_s());
    return {.min_workers = scaling_config_->min_workers(),
            .monitor_interval = interval,
            .host_wait = std::min(host_wait_, interval),
            .plan_on = std::move(plan_on)};
  }

  launch::LauncherKind kind_;
  std::optional<config::ScalingConfig> scaling_config_;
  Duration host_wait_;  // FailureConfig.unreachable_host_timeout_s: ssh hosts, Slurm nodes
  controller::ControllerOptions options_;  // until the controller is made
  std::unique_ptr<controller::Controller> controller_;
};

// Staged files as report(checkpoint=) describes them to the controller.
nb::list EntriesToList(const std::vector<storage::FileEntry>& entries) {
  nb::list out;
  for (const auto& e : entries) {
    nb::dict d;
    d["path"] = e.path;
    d["size"] = e.size;
    d["crc32c"] = e.crc32c;
    d["mode"] = e.mode;
    if (!e.link.empty()) d["link"] = e.link;
    if (!e.sha256.empty()) d["sha256"] = e.sha256;  // hex; staged with hash only
    out.append(d);
  }
  return out;
}

class PyWorkerClient {
 public:
  static PyWorkerClient Connect(const std::string& address, const std::string& secret_hex,
                                uint32_t rank, uint32_t attempt, double timeout_s,
                                const std::string& registration_json) {
    worker::WorkerClientOptions o;
    o.controller = Unwrap(wire::ParseHostPort(address));
    o.secret = Unwrap(wire::FromHex(secret_hex));
    o.rank = rank;
    o.attempt = attempt;
    o.timeout = Seconds(timeout_s);
    o.registration = registration_json;
    StatusOr<std::unique_ptr<worker::WorkerClient>> client = UnavailableError("");
    {
      nb::gil_scoped_release release;
      client = worker::WorkerClient::Connect(o);
    }
    return PyWorkerClient(Unwrap(std::move(client)));
  }

  nb::tuple WaitStart() {
    StatusOr<worker::StartInfo> info = UnavailableError("");
    {
      nb::gil_scoped_release release;
      info = client_->WaitStart();
    }
    worker::StartInfo i = Unwrap(std::move(info));
    return nb::make_tuple(i.json, nb::bytes(i.payload.data(), i.payload.size()));
  }

  void ReportCheckpoint(uint64_t round, std::string_view checkpoint_json,
                        std::string_view metrics_json) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->ReportCheckpoint(round, checkpoint_json, metrics_json);
    }
    Check(s);
  }

  void WaitCheckpointsSettled() {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->WaitCheckpointsSettled();
    }
    Check(s);
  }

  // Whether a profile request waits (WorkerClient::NoteRound()), learnt with the report.
  bool Report(uint64_t round, std::string_view metrics_json) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->Report(round, metrics_json);
    }
    Check(s);
    return client_->profile_requested();  // Report() noted the round
  }

  // Blocks, without the GIL, until every rank has made the call; returns rank 0's data for a
  // broadcast, b"" for a barrier.
  nb::bytes Collective(uint64_t sequence, bool broadcast, nb::bytes data) {
    wire::Collective call{
        .sequence = sequence,
        .kind = broadcast ? wire::CollectiveKind::kBroadcast : wire::CollectiveKind::kBarrier,
        .data = std::string_view(data.c_str(), data.size())};
    StatusOr<std::string> released = UnavailableError("");
    {
      nb::gil_scoped_release release;
      released = client_->Collective(call);
    }
    std::string out = Unwrap(std::move(released));
    return nb::bytes(out.data(), out.size());
  }

  // Both wait until the controller's host has acknowledged them (up to 10 s).
  void SendError(std::string_view json) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->SendError(json);
    }
    Check(s);
  }
  void SendDone(std::string_view json) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->SendDone(json);
    }
    Check(s);
  }
  void WatchController(int exit_code) { client_->WatchController(exit_code); }
  void WatchPreemption(int usr1_notice_s) { Check(client_->WatchPreemption(usr1_notice_s)); }
  void SendPreemptionNotice(std::string_view source, uint64_t deadline_ms) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->SendPreemptionNotice(source, deadline_ms);
    }
    Check(s);
  }
  std::string PreemptionCall() {
    nb::gil_scoped_release release;
    return client_->PreemptionCall();
  }
  bool NoteRound(uint64_t round) { return client_->NoteRound(round); }
  void EnableStacks(int fd, int signal, uint64_t thread) {
    client_->EnableStacks(fd, signal, thread);
  }
  std::string TakeProfileRequest() { return client_->TakeProfileRequest(); }
  void Stop() {
    nb::gil_scoped_release release;
    client_->Stop();
  }

 private:
  explicit PyWorkerClient(std::unique_ptr<worker::WorkerClient> c) : client_(std::move(c)) {}
  std::shared_ptr<worker::WorkerClient> client_;
};

}  // namespace
}  // namespace jaxtrain

NB_MODULE(_core, m) {
  using namespace jaxtrain;
  m.doc() = "The jaxtrain engine (C++).";

  nb::class_<config::ScalingConfig>(m, "ScalingConfig")
      .def(
          "__init__",
          [](config::ScalingConfig* self, int num_workers, bool use_tpu, bool use_gpu,
             std::optional<std::string> topology, std::optional<std::string> accelerator_type,
             std::optional<std::map<std::string, double>> resources_per_worker,
             std::string placement_strategy, std::optional<int> min_workers,
             double elastic_resize_monitor_interval_s) {
            config::ScalingConfigInput in;
            in.num_workers = num_workers;
            in.min_workers = min_workers;
            in.elastic_resize_monitor_interval_s = elastic_resize_monitor_interval_s;
            in.use_tpu = use_tpu;
            in.use_gpu = use_gpu;
            in.topology = std::move(topology);
            in.accelerator_type = std::move(accelerator_type);
            in.resources_per_worker =
                resources_per_worker.value_or(std::map<std::string, double>{});
            in.placement_strategy = std::move(placement_strategy);
            new (self) config::ScalingConfig(Unwrap(config::ScalingConfig::Create(std::move(in))));
          },
          "num_workers"_a, "use_tpu"_a, "use_gpu"_a, "topology"_a.none(),
          "accelerator_type"_a.none(), "resources_per_worker"_a.none(), "placement_strategy"_a,
          "min_workers"_a.none() = nb::none(),
          "elastic_resize_monitor_interval_s"_a = config::kDefaultResizeMonitorIntervalS)
      .def_prop_ro("resources_per_worker", &config::ScalingConfig::resources_per_worker)
      .def_prop_ro("min_workers", &config::ScalingConfig::min_workers)
      .def_prop_ro("elastic", &config::ScalingConfig::elastic)
      .def_prop_ro("workers_per_slice", &config::ScalingConfig::workers_per_slice)
      .def_prop_ro("num_slices", &config::ScalingConfig::num_slices)
      .def_prop_ro("tpu_slice", [](const config::ScalingConfig& c) -> nb::object {
        if (!c.tpu_slice()) return nb::none();
        const auto& s = *c.tpu_slice();
        nb::dict d;
        d["generation"] = std::string(accelerators::GenerationName(s.generation));
        d["topology"] = s.topology;
        d["chips"] = s.chips;
        d["chips_per_host"] = s.chips_per_host;
        d["hosts"] = s.hosts;
        d["pod_type"] = s.pod_type;
        return d;
      });

  nb::class_<config::RunConfig>(m, "RunConfig")
      .def(
          "__init__",
          [](config::RunConfig* self, std::optional<std::string> name,
             std::optional<std::string> storage_path) {
            new (self) config::RunConfig(Unwrap(config::RunConfig::Create(
                {.name = std::move(name), .storage_path = std::move(storage_path)})));
          },
          "name"_a.none(), "storage_path"_a.none())
      .def_prop_ro("name", &config::RunConfig::name)
      .def_prop_ro("storage_path", &config::RunConfig::storage_path);

  nb::class_<config::CheckpointConfig>(m, "CheckpointConfig")
      .def(
          "__init__",
          [](config::CheckpointConfig* self, std::optional<int> num_to_keep,
             std::optional<std::string> checkpoint_score_attribute,
             std::string checkpoint_score_order) {
            new (self) config::CheckpointConfig(Unwrap(config::CheckpointConfig::Create(
                {.num_to_keep = num_to_keep,
                 .checkpoint_score_attribute = std::move(checkpoint_score_attribute),
                 .checkpoint_score_order = std::move(checkpoint_score_order)})));
          },
          "num_to_keep"_a.none(), "checkpoint_score_attribute"_a.none(),
          "checkpoint_score_order"_a);

  nb::class_<config::FailureConfig>(m, "FailureConfig")
      .def(
          "__init__",
          [](config::FailureConfig* self, int max_failures, int controller_failure_limit,
             std::optional<double> progress_timeout_s, int max_preemption_failures,
             double preemption_grace_s, double unreachable_host_timeout_s,
             bool progress_timeout_auto) {
            new (self) config::FailureConfig(Unwrap(config::FailureConfig::Create(
                {.max_failures = max_failures,
                 .controller_failure_limit = controller_failure_limit,
                 .progress_timeout_s = progress_timeout_s,
                 .progress_timeout_auto = progress_timeout_auto,
                 .max_preemption_failures = max_preemption_failures,
                 .preemption_grace_s = preemption_grace_s,
                 .unreachable_host_timeout_s = unreachable_host_timeout_s})));
          },
          "max_failures"_a, "controller_failure_limit"_a, "progress_timeout_s"_a.none(),
          "max_preemption_failures"_a = -1, "preemption_grace_s"_a = 30.0,
          "unreachable_host_timeout_s"_a = 300.0, "progress_timeout_auto"_a = false);

  m.def(
      "stage_directory",
      [](const std::string& src, const std::string& dst, bool durable, bool sha256) {
        StatusOr<std::vector<storage::FileEntry>> entries = InternalError("");
        {
          nb::gil_scoped_release release;
          entries = storage::StageDirectory(src, dst, durable, sha256);
        }
        return EntriesToList(Unwrap(std::move(entries)));
      },
      "src"_a, "dst"_a, "durable"_a = true, "sha256"_a = false,
      "Copies a checkpoint directory into staging; returns its files (sizes, CRC-32C, modes) and "
      "kept links. Without durable, the copy is not fsynced (the commit fsyncs it). With sha256, "
      "each file's SHA-256 (hex) too, computed in the same pass over its bytes.");

  nb::class_<storage::DirectorySnapshot>(m, "DirectorySnapshot")
      .def_prop_ro("bytes", [](const storage::DirectorySnapshot& s) { return s.bytes; })
      .def(
          "write",
          [](storage::DirectorySnapshot& s, const std::string& dst, bool release, bool sha256) {
            StatusOr<std::vector<storage::FileEntry>> entries = InternalError("");
            {
              nb::gil_scoped_release gil;
              entries = storage::WriteSnapshot(s, dst, sha256);
              // The memory goes back at once, written or not, unless it is to be written again.
              if (release || !entries.ok()) s = storage::DirectorySnapshot();
            }
            return EntriesToList(Unwrap(std::move(entries)));
          },
          "dst"_a, "release"_a = true, "sha256"_a = false,
          "Writes the snapshot into dst as stage_directory(durable=False) would have copied its "
          "source, computing the checksums (with sha256, each file's SHA-256 too, hex, once per "
          "snapshot); returns the files as stage_directory does. Then frees its memory, unless "
          "release is False (to write it again).")
      .def(
          "describe",
          [](const storage::DirectorySnapshot& s, bool sha256) {
            std::vector<storage::FileEntry> entries;
            {
              nb::gil_scoped_release gil;
              entries = storage::DescribeSnapshot(s, sha256);
            }
            return EntriesToList(entries);
          },
          "sha256"_a = false,
          "The files as write() would return them, computed from memory without writing: CRC-32C "
          "and, with sha256, SHA-256 (hex, once per snapshot), in one pass over each file.")
      .def(
          "read",
          [](const storage::DirectorySnapshot& s, const std::string& path, uint64_t offset,
             uint64_t size) {
            for (const storage::DirectorySnapshot::Item& item : s.items) {
              if (item.kind != storage::DirectorySnapshot::Kind::kFile || item.rel != path) {
                continue;
              }
              if (offset > item.size) {
                throw nb::value_error(("offset " + std::to_string(offset) +
                                       " is past the end of '" + path + "' (" +
                                       std::to_string(item.size) + " bytes)")
                                          .c_str());
              }
              const size_t n = static_cast<size_t>(std::min(size, item.size - offset));
              nb::object out =
                  nb::steal(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n)));
              if (!out.is_valid()) throw nb::python_error();
              char* to = PyBytes_AsString(out.ptr());
              {
                nb::gil_scoped_release gil;
                std::memcpy(to, item.data.get() + offset, n);
              }
              return out;
            }
            throw nb::key_error(("the snapshot has no file '" + path + "'").c_str());
          },
          "path"_a, "offset"_a, "size"_a,
          "Up to size bytes of the snapshot's file at path (relative, as describe() names it) "
          "from offset, as bytes: a part of an upload from memory. Thread-safe; KeyError for a "
          "path the snapshot has no file at.")
      .def(
          "files",
          [](const storage::DirectorySnapshot& s) {
            nb::list out;
            for (const storage::DirectorySnapshot::Item& item : s.items) {
              if (item.kind == storage::DirectorySnapshot::Kind::kFile) {
                out.append(nb::make_tuple(item.rel, item.size));
              }
            }
            return out;
          },
          "The snapshot's files as (path, size), in the order describe() lists them; no "
          "checksum is computed.")
      .def(
          "release", [](storage::DirectorySnapshot& s) { s = storage::DirectorySnapshot(); },
          "Frees the snapshot's memory (what describe() and read() use).");
  m.def(
      "sha256_implementation", [] { return std::string(storage::Sha256::Implementation()); },
      "What computes the SHA-256s of checkpoints in this process: 'openssl' (the CPU's SHA "
      "instructions where present) or 'libsodium' (portable, where no libcrypto can be loaded).");

  m.def(
      "crc32c",
      [](nb::handle data, uint32_t crc) {
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
        {
          nb::gil_scoped_release release;
          crc = storage::Crc32c(crc, view.buf, static_cast<size_t>(view.len));
        }
        PyBuffer_Release(&view);
        return crc;
      },
      "data"_a, "crc"_a = 0,
      "Extends the CRC-32C `crc` (0 to start) with `data` (bytes, or any contiguous buffer: "
      "bytearray, memoryview, mmap), as checkpoint manifests record it.");

  m.def(
      "snapshot_directory",
      [](const std::string& src, uint64_t budget_bytes) -> nb::object {
        StatusOr<storage::DirectorySnapshot> snapshot = InternalError("");
        {
          nb::gil_scoped_release release;
          snapshot = storage::SnapshotDirectory(src, budget_bytes);
        }
        if (snapshot.status().code() == StatusCode::kResourceExhausted) return nb::none();
        return nb::cast(Unwrap(std::move(snapshot)));
      },
      "src"_a, "budget_bytes"_a,
      "Reads a checkpoint directory into memory (DirectorySnapshot), by the rules of "
      "stage_directory; None when its files hold more than budget_bytes together.");

  m.def(
      "verify_checkpoint",
      [](const std::string& dir, bool checksums, int threads) {
        Status s;
        {
          nb::gil_scoped_release release;
          s = storage::VerifyCheckpoint(dir, checksums, threads);
        }
        Check(s);
      },
      "dir"_a, "checksums"_a, "threads"_a = 0);

  m.def("is_clean_relative_path", &storage::IsCleanRelativePath, "path"_a,
        "Whether a checkpoint file's path stays inside its directory: relative, with no empty, "
        "'.' or '..' component (the rule the commit applies to staged files).");

  m.def(
      "ranked_checkpoints",
      [](const std::string& run_dir, std::optional<std::string> score_attribute,
         bool higher_is_better) {
        std::vector<std::string> warnings;
        auto index = Unwrap(storage::CheckpointIndex::Load(run_dir, &warnings));
        storage::RetentionPolicy policy{.score_attribute = std::move(score_attribute),
                                        .higher_is_better = higher_is_better};
        storage::Validations validated = storage::ApplyValidations(run_dir, index.records());
        nb::list out;
        for (const auto& r : storage::RankByScore(std::move(validated.records), policy)) {
          out.append(nb::make_tuple(r.dir_name, r.metrics.dump()));
        }
        return out;
      },
      "run_dir"_a, "score_attribute"_a.none(), "higher_is_better"_a,
      "The committed checkpoints of a run directory, best first: (dir_name, metrics JSON, with "
      "what their validations returned merged in).");

  m.def(
      "apply_retention",
      [](const std::string& run_dir, int num_to_keep, std::optional<std::string> score_attribute,
         bool higher_is_better) {
        storage::RetentionPolicy policy{.num_to_keep = num_to_keep,
                                        .score_attribute = std::move(score_attribute),
                                        .higher_is_better = higher_is_better};
        StatusOr<std::vector<std::string>> warnings = [&] {
          nb::gil_scoped_release release;
          return storage::ApplyRetention(run_dir, policy);
        }();
        return Unwrap(std::move(warnings));
      },
      "run_dir"_a, "num_to_keep"_a, "score_attribute"_a.none(), "higher_is_better"_a,
      "Applies CheckpointConfig's retention to a run directory whose controller has ended, "
      "scored with what validations returned; one line per checkpoint it could not delete.");

  nb::class_<placement::Plan>(m, "Plan").def(
      "to_dict", &PlanToDict,
      "platform, accelerator, simulated, hosts_source, num_slices, and per rank: rank, "
      "local_rank, local_world_size, node_rank, host, address, slice, devices, env, "
      "unset_env.");

  m.def(
      "plan_local",
      [](const config::ScalingConfig& c) {
        return Unwrap(placement::PlanLocal(c, accelerators::RealHost()));
      },
      "scaling_config"_a,
      "Plans for the local launcher: the hosts of JAXTRAIN_HOSTS, the simulated hosts "
      "(JAXTRAIN_SIMULATE=1), or this machine.");

  m.def(
      "plan",
      [](const config::ScalingConfig& c, const std::string& hosts_json,
         const std::map<std::string, std::string>& environ, bool simulate) {
        placement::HostDescription hosts =
            Unwrap(placement::ParseHostDescription(hosts_json, "hosts_json", environ, ""));
        return Unwrap(placement::PlanOnHosts(c, hosts, environ, simulate));
      },
      "scaling_config"_a, "hosts_json"_a, "environ"_a, "simulate"_a,
      "Plans over the hosts of a JSON host description, as inherited from `environ`; reads "
      "nothing of this machine.");

  m.def(
      "choose_launcher",
      [] {
        return std::string(
            launch::LauncherKindName(Unwrap(launch::ChooseLauncher(accelerators::RealHost()))));
      },
      "'local', 'slurm', 'ssh' or 'kubernetes': JAXTRAIN_LAUNCHER, or by default ssh when hosts "
      "are listed, slurm inside a Slurm allocation.");

  m.def(
      "plan_slurm",
      [](const config::ScalingConfig& c) {
        return Unwrap(launch::PlanForSlurm(c, accelerators::RealHost()));
      },
      "scaling_config"_a,
      "Plans for the Slurm launcher: one environment for every rank; Slurm places them.");

  m.attr("MAX_WORKERS") = config::kMaxWorkers;
  m.attr("SSH_OPTIONS") = nb::tuple(nb::cast(launch::kSshOptions));
  {
    std::vector<std::string> prefixes(std::begin(launch::kForwardedPrefixes),
                                      std::end(launch::kForwardedPrefixes));
    m.attr("SSH_FORWARDED_ENV_PREFIXES") = nb::tuple(nb::cast(prefixes));
  }
  m.attr("MAX_BROADCAST_BYTES") = wire::kMaxCollectiveData;
  {
    std::vector<std::string> names(std::begin(launch::kActivationEnv),
                                   std::end(launch::kActivationEnv));
    m.attr("ACTIVATION_ENV") = nb::tuple(nb::cast(names));
  }
  m.def(
      "warm_workers_requested", [] { return Unwrap(launch::WarmWorkersRequested()); },
      "JAXTRAIN_WARM_WORKERS: whether standby workers are kept (docs/warm-workers.md); "
      "ValueError naming the value when it is neither 1 nor 0.");
  m.def(
      // With the GIL held (it takes milliseconds): the driver calls it from a daemon thread,
      // which must not take the GIL back inside C++ while the interpreter exits.
      "end_idle_standbys", [] { return launch::StandbyPool::Driver().EndFree(); },
      "Ends the standby workers this driver keeps for a later fit() (none runs now that they "
      "serve) and returns how many it ended (docs/warm-workers.md).");
  m.def(
      "check_local_workers",
      [](const config::ScalingConfig& c) {
        Check(config::CheckLocalWorkerCount(c, accelerators::RealHost().CpuCount()));
      },
      "scaling_config"_a,
      "Raises ValueError when a local run of `scaling_config` has more workers than this "
      "machine starts (config::LocalWorkerLimit).");

  m.def(
      "run_lock_holder",
      [](const std::string& run_dir) { return Unwrap(storage::RunStore::LockHolder(run_dir)); },
      "run_dir"_a,
      "The driver holding the run directory's lock ('host H, pid P, since T'), or None when no "
      "live driver holds it.");

  m.def(
      "plan_kubernetes",
      [](const config::ScalingConfig& c) {
        return Unwrap(launch::PlanForKubernetes(c, accelerators::RealHost()));
      },
      "scaling_config"_a,
      "Plans for the Kubernetes launcher: one environment for every rank, one pod each.");

  m.def(
      "kubernetes_jobset",
      [](const config::ScalingConfig& c, const std::string& options_json,
         const std::string& jobset_name, const std::map<std::string, std::string>& env) {
        auto json = nlohmann::json::parse(options_json, nullptr, false);
        launch::KubernetesOptions k = Unwrap(launch::KubernetesOptions::FromJson(json));
        placement::Plan plan = Unwrap(launch::PlanForKubernetes(c, accelerators::RealHost()));
        return Unwrap(launch::JobSetManifest(c, plan, k, jobset_name, env)).dump();
      },
      "scaling_config"_a, "options_json"_a, "jobset_name"_a, "env"_a,
      "The JobSet (JSON) the Kubernetes launcher would create; for `jaxtrain plan`.");

  m.def(
      "plan_ssh",
      [](const config::ScalingConfig& c) {
        return Unwrap(launch::PlanForSsh(c, accelerators::RealHost()));
      },
      "scaling_config"_a,
      "Plans for the ssh launcher over the hosts of JAXTRAIN_HOSTFILE, JAXTRAIN_SSH_HOSTS or "
      "JAXTRAIN_HOSTS.");

  m.def(
      "describe_this_host",
      [] {
        const accelerators::HostView& view = accelerators::RealHost();
        const placement::Host host = placement::DescribeThisHost(view).hosts.front();
        nb::dict d;
        d["name"] = host.name;
        d["gpus"] = host.gpus.size();
        d["tpu_chips"] = host.tpu_chips;
        // The slice this host says it is in (TPU_NAME, TPU_WORKER_ID); empty when it does not say.
        const accelerators::TpuHostIdentity identity = accelerators::ReadTpuHostIdentity(view);
        d["tpu_slice"] = identity.name;
        d["tpu_worker_id"] = host.tpu_worker_id;
        d["tpu_accelerator_type"] = host.tpu_accelerator_type;
        d["tpu_topology"] = host.tpu_topology;
        return d;
      },
      "This machine as placement sees it: name, gpus (count), tpu_chips, and its TPU identity.");

  m.def(
      "check_shared_storage",
      [](const std::string& path) {
        Check(launch::CheckSharedStorage(path, accelerators::RealHost()));
      },
      "path"_a, "Raises ValueError when `path` is on storage local to this host.");

  // The secure channel (wire/channel.h) over a connected socket's descriptor, which the caller
  // keeps open while the channel is used. Errors: PermissionError (the other end refused, or does
  // not hold the secret), TimeoutError, ConnectionError, ValueError.
  nb::class_<wire::Channel>(m, "Channel")
      .def_prop_ro("peer", &wire::Channel::peer, "The other end's proven name.")
      .def(
          "send",
          [](wire::Channel& c, nb::bytes data, std::optional<double> timeout_s) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = c.Send(std::string_view(data.c_str(), data.size()), ChannelTimeout(timeout_s));
            }
            Check(ChannelError(s));
          },
          "data"_a, "timeout_s"_a = nb::none(), "Sends `data` sealed, in records of at most 1 MiB.")
      .def(
          "send_file",
          [](wire::Channel& c, int file_fd, uint64_t size, std::optional<double> timeout_s) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = c.SendFile(file_fd, size, ChannelTimeout(timeout_s));
            }
            Check(ChannelError(s));
          },
          "file_fd"_a, "size"_a, "timeout_s"_a = nb::none(),
          "Sends the first `size` bytes of the open file `file_fd`, sealed.")
      .def(
          "receive",
          [](wire::Channel& c, std::optional<double> timeout_s) {
            StatusOr<std::string> got = UnavailableError("");
            {
              nb::gil_scoped_release release;
              got = c.Receive(ChannelTimeout(timeout_s));
            }
            std::string data = Unwrap(ChannelError(std::move(got)));
            return nb::bytes(data.data(), data.size());
          },
          "timeout_s"_a = nb::none(), "The next record's bytes, checked.")
      .def(
          "receive_into",
          [](wire::Channel& c, nb::handle buffer, std::optional<double> timeout_s) {
            Py_buffer view;
            if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_SIMPLE | PyBUF_WRITABLE) != 0) {
              throw nb::python_error();
            }
            StatusOr<size_t> got = UnavailableError("");
            {
              nb::gil_scoped_release release;
              got = c.ReceiveInto(static_cast<char*>(view.buf), static_cast<size_t>(view.len),
                                  ChannelTimeout(timeout_s));
            }
            PyBuffer_Release(&view);
            return Unwrap(ChannelError(std::move(got)));
          },
          "buffer"_a, "timeout_s"_a = nb::none(),
          "The next record's bytes, checked, into `buffer` (a writable buffer of at least 1 MiB "
          "holds any record); returns how many.");
  m.def(
      "channel_connect",
      [](int fd, nb::bytes secret, const std::string& purpose, const std::string& me,
         const std::string& responder, double timeout_s) {
        StatusOr<wire::Channel> c = UnavailableError("");
        {
          nb::gil_scoped_release release;
          c = wire::Channel::Connect(fd, std::string_view(secret.c_str(), secret.size()),
                                     {purpose, me, responder}, Seconds(timeout_s));
        }
        return Unwrap(ChannelError(std::move(c)));
      },
      "fd"_a, "secret"_a, "purpose"_a, "me"_a, "responder"_a, "timeout_s"_a,
      "The connecting end's handshake on the connected socket `fd`: proves `me` to `responder` "
      "for `purpose` with `secret`, and returns the channel.");
  m.def(
      "channel_accept",
      [](int fd, nb::bytes secret, const std::string& purpose, const std::string& me,
         std::vector<std::string> initiators, double timeout_s) {
        StatusOr<wire::Channel> c = UnavailableError("");
        {
          nb::gil_scoped_release release;
          c = wire::Channel::Accept(fd, std::string_view(secret.c_str(), secret.size()), purpose,
                                    me, initiators, Seconds(timeout_s));
        }
        return Unwrap(ChannelError(std::move(c)));
      },
      "fd"_a, "secret"_a, "purpose"_a, "me"_a, "initiators"_a, "timeout_s"_a,
      "The accepting end's handshake on the accepted socket `fd`, all of it within `timeout_s`: "
      "accepts an end in `initiators` (any when empty) that proves it holds `secret` and means "
      "`me` for `purpose`; the channel's `peer` is its name.");

  nb::class_<PyControllerOptions>(m, "ControllerOptions",
                                  "The options of Controller(**options), one field each.")
      .def(nb::init<>())
      .def_rw("run_dir", &PyControllerOptions::run_dir)
      .def_rw("experiment_name", &PyControllerOptions::experiment_name)
      .def_rw("plan", &PyControllerOptions::plan)
      .def_rw("worker_argv", &PyControllerOptions::worker_argv)
      .def_rw("worker_cwd", &PyControllerOptions::worker_cwd)
      .def_rw("worker_env", &PyControllerOptions::worker_env)
      .def_rw("payload", &PyControllerOptions::payload)
      .def_rw("run_config_json", &PyControllerOptions::run_config_json)
      .def_rw("terminate_grace_s", &PyControllerOptions::terminate_grace_s)
      .def_rw("start_timeout_s", &PyControllerOptions::start_timeout_s)
      .def_rw("progress_timeout_floor_s", &PyControllerOptions::progress_timeout_floor_s)
      .def_rw("failure_config", &PyControllerOptions::failure_config)
      .def_rw("checkpoint_config", &PyControllerOptions::checkpoint_config)
      .def_rw("verify_checksums", &PyControllerOptions::verify_checksums)
      .def_rw("console_fd", &PyControllerOptions::console_fd)
      .def_rw("launcher", &PyControllerOptions::launcher, "'local', 'slurm', 'ssh' or 'kubernetes'")
      .def_rw("scaling_config", &PyControllerOptions::scaling_config,
              "required by every launcher but 'local'")
      .def_rw("status_line", &PyControllerOptions::status_line)
      .def_rw("launcher_options_json", &PyControllerOptions::launcher_options_json)
      .def_rw("memory_store", &PyControllerOptions::memory_store)
      .def_rw("verbose", &PyControllerOptions::verbose);

  nb::class_<PyController>(m, "Controller")
      .def(
          "__init__", &PyController::Init,
          "Controller(**options): the fields of ControllerOptions by name; an unknown option, or a "
          "missing one that the run needs, is a TypeError naming it.")
      .def("start", &PyController::Start)
      .def("wait", &PyController::Wait, "timeout_s"_a)
      .def("wait_for_commits", &PyController::WaitForCommits, "seen"_a, "timeout_s"_a,
           "Waits up to timeout_s until more than `seen` checkpoints have been committed, or the "
           "run has ended; the number committed so far.")
      .def("abort", &PyController::Abort, "reason"_a)
      .def("take_stacks", &PyController::TakeStacks, "timeout_s"_a)
      .def("start_profile", &PyController::StartProfile, "steps"_a, "timeout_s"_a)
      .def("outcome", &PyController::Outcome)
      .def("metrics_json", &PyController::MetricsJson)
      .def("close", &PyController::Close);

  nb::class_<PyWorkerClient>(m, "WorkerClient")
      .def_static("connect", &PyWorkerClient::Connect, "address"_a, "secret_hex"_a, "rank"_a,
                  "attempt"_a, "timeout_s"_a, "registration_json"_a)
      .def("wait_start", &PyWorkerClient::WaitStart)
      .def("report", &PyWorkerClient::Report, "round"_a, "metrics_json"_a)
      .def("report_checkpoint", &PyWorkerClient::ReportCheckpoint, "round"_a, "checkpoint_json"_a,
           "metrics_json"_a)
      .def("wait_checkpoints_settled", &PyWorkerClient::WaitCheckpointsSettled)
      .def("collective", &PyWorkerClient::Collective, "sequence"_a, "broadcast"_a, "data"_a)
      .def("send_error", &PyWorkerClient::SendError, "json"_a)
      .def("send_done", &PyWorkerClient::SendDone, "json"_a)
      .def("watch_controller", &PyWorkerClient::WatchController, "exit_code"_a)
      .def("watch_preemption", &PyWorkerClient::WatchPreemption, nb::arg("usr1_notice_s") = -1)
      .def("send_preemption_notice", &PyWorkerClient::SendPreemptionNotice, "source"_a,
           "deadline_ms"_a)
      .def("preemption_call", &PyWorkerClient::PreemptionCall)
      .def("note_round", &PyWorkerClient::NoteRound, "round"_a)
      .def("enable_stacks", &PyWorkerClient::EnableStacks, "fd"_a, "signal"_a, "thread"_a)
      .def("take_profile_request", &PyWorkerClient::TakeProfileRequest)
      .def("stop", &PyWorkerClient::Stop);
}
