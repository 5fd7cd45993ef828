#include "launch/slurm_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "base/fd_io.h"
#include "base/strings.h"
#include "launch/ssh_launcher.h"
#include "launch/standby_pool.h"
#include "placement/elastic.h"

namespace jaxtrain::launch {
namespace {

// Set per task by each worker from Slurm's variables (SLURM_PROCID, ...), never by the launcher.
const std::set<std::string> kPerRankEnv = {"JAXTRAIN_RANK", "JAXTRAIN_LOCAL_RANK",
                                           "JAXTRAIN_LOCAL_WORLD_SIZE", "JAXTRAIN_NODE_RANK"};

constexpr auto kReasonPollInterval = std::chrono::seconds(5);

std::vector<std::string> SplitLines(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string_view::npos) nl = text.size();
    std::string line = Trim(text.substr(start, nl - start));
    if (!line.empty()) out.push_back(std::move(line));
    start = nl + 1;
  }
  return out;
}

std::optional<int> ParseWhole(std::string_view s) {
  if (s.empty() || s.size() > 9) return std::nullopt;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

// Starts a Slurm command (looked up in PATH), in a new process group when `new_group`.
// Errors: kUnavailable naming the program and why.
StatusOr<Spawned> Spawn(const std::vector<std::string>& argv,
                        const std::map<std::string, std::string>* env, bool new_group,
                        int stdin_fd = -1) {
  std::vector<std::string> env_strings;
  if (env != nullptr) {
    for (const auto& [k, v] : *env) env_strings.push_back(k + "=" + v);
  }
  SpawnOptions options{
      .argv = argv, .env = env != nullptr ? &env_strings : nullptr, .search_path = true};
  if (new_group) options.process_group = 0;
  options.stdin_fd = stdin_fd;
  auto spawned = SpawnWithOutputPipe(options);
  if (!spawned.ok()) {
    return UnavailableError("cannot start '" + argv[0] + "': " + spawned.status().message() +
                            (spawned.status().code() == StatusCode::kNotFound
                                 ? " (is Slurm's client installed and on PATH?)"
                                 : ""));
  }
  return *spawned;
}

// Runs a short Slurm command to its end (RunToEnd), killing it after `timeout` (Slurm's clients
// retry an unreachable slurmctld for MessageTimeout, 10 s by default, several times; the loop that
// asks must never wait for one without bound). Errors: as RunToEnd, all but kCancelled and
// kDeadlineExceeded as kUnavailable.
StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                 Duration timeout = kSlurmCommandTimeout, int cancel_fd = -1) {
  StatusOr<std::string> out = RunToEnd({.argv = argv, .search_path = true}, timeout, cancel_fd);
  switch (out.status().code()) {
    case StatusCode::kNotFound:
      return UnavailableError(out.status().message() +
                              " (is Slurm's client installed and on PATH?)");
    case StatusCode::kDeadlineExceeded:
      return DeadlineExceededError(out.status().message() + " (is slurmctld reachable?)");
    case StatusCode::kOk:
    case StatusCode::kCancelled: return out;
    default: return UnavailableError(out.status().message());
  }
}

std::string FilesystemName(int64_t type) {
  switch (static_cast<uint32_t>(type)) {
    case 0xEF53: return "ext2/ext3/ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlayfs";
    case 0x2FC12FC1: return "zfs";
    case 0xF2F52010: return "f2fs";
    default: break;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "type 0x%llx", static_cast<unsigned long long>(type));
  return buf;
}

bool IsNetworkFilesystem(int64_t type) {
  switch (static_cast<uint32_t>(type)) {
    case 0x6969:      // NFS
    case 0x517B:      // SMB
    case 0xFF534D42:  // CIFS
    case 0xFE534D42:  // SMB2
    case 0x0BD00BD0:  // Lustre
    case 0x47504653:  // GPFS
    case 0x19830326:  // BeeGFS
    case 0x00C36400:  // CephFS
    case 0x01021997:  // 9p
    case 0x5346414F:  // AFS
    case 0x6B414653:  // kAFS
    case 0x7461636F:  // OCFS2
    case 0xAAD7AAEA:  // PanFS
    case 0x65735546:  // FUSE (sshfs, gcsfuse, s3fs, GlusterFS, JuiceFS, ...)
      return true;
    default: return false;
  }
}

// "0-1,3" -> {0, 1, 3}.
std::optional<std::vector<int>> ParseTaskList(std::string_view text) {
  std::vector<int> out;
  while (!text.empty()) {
    size_t comma = text.find(',');
    std::string_view item = text.substr(0, comma);
    size_t dash = item.find('-');
    auto first = ParseWhole(item.substr(0, dash));
    auto last = dash == std::string_view::npos ? first : ParseWhole(item.substr(dash + 1));
    if (!first || !last || *last < *first || *last - *first > 100000) return std::nullopt;
    for (int t = *first; t <= *last; ++t) out.push_back(t);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

StatusOr<std::optional<int>> PositiveSetting(const accelerators::HostView& env, const char* name) {
  auto value = env.GetEnv(name);
  if (!value || value->empty()) return std::optional<int>();
  auto v = ParseWhole(*value);
  if (!v || *v < 1) {
    return InvalidArgumentError(std::string(name) + "='" + *value +
                                "' is not allowed; it must be a whole number >= 1");
  }
  return std::optional<int>(*v);
}

bool IsTrue(const std::optional<std::string>& v) {
  return v && !v->empty() && *v != "0" && *v != "false" && *v != "no";
}

bool Simulated(const accelerators::HostView& env) {
  auto v = env.GetEnv(placement::kSimulateEnv);
  return v && !v->empty() && *v != "0";
}

// An elastic config's allocation: whole nodes of w tasks when w is known (the tasks per node, or
// max / JAXTRAIN_SLURM_NODES), asked for as a node range; --no-kill in any case.
Status ElasticShape(const config::ScalingConfig& config, SlurmShape* shape) {
  const int min = config.min_workers();
  const int max = config.num_workers();
  const std::string range =
      "ScalingConfig.num_workers=(" + std::to_string(min) + ", " + std::to_string(max) + ")";
  if (config.use_tpu()) {
    return InvalidArgumentError(range +
                                " with use_tpu=True is not allowed on Slurm: an elastic "
                                "run resizes TPU slices on ssh hosts only (docs/elastic.md); "
                                "give num_workers one number");
  }
  shape->no_kill = true;
  std::optional<int> per_node = shape->tasks_per_node;
  if (!per_node && shape->nodes) {
    if (max % *shape->nodes != 0) {
      return InvalidArgumentError(range + " is not allowed with " + kSlurmNodesEnv + "=" +
                                  std::to_string(*shape->nodes) +
                                  ": an elastic run on Slurm runs the same number of workers on "
                                  "each node; allowed: a max that is a multiple of the nodes");
    }
    per_node = max / *shape->nodes;
  }
  if (!per_node) return OkStatus();  // max tasks; the nodes Slurm gives set the unit
  if (min % *per_node != 0 || max % *per_node != 0) {
    return InvalidArgumentError(range + " is not allowed with " + std::to_string(*per_node) +
                                " task(s) per node: an elastic run on Slurm grows and shrinks by "
                                "whole nodes; allowed: min and max multiples of " +
                                std::to_string(*per_node));
  }
  shape->tasks_per_node = per_node;
  shape->nodes = max / *per_node;
  shape->min_nodes = min / *per_node;
  return OkStatus();
}

}  // namespace

std::vector<std::string> SlurmShape::SrunArgs() const {
  std::vector<std::string> args = {"--ntasks=" + std::to_string(tasks),
                                   "--cpus-per-task=" + std::to_string(cpus_per_task)};
  if (nodes) args.push_back("--nodes=" + std::to_string(*nodes));
  if (tasks_per_node) args.push_back("--ntasks-per-node=" + std::to_string(*tasks_per_node));
  if (gpus_per_task > 0) args.push_back("--gpus-per-task=" + std::to_string(gpus_per_task));
  if (exclusive) args.push_back("--exclusive");
  if (!constraint.empty()) args.push_back("--constraint=" + constraint);
  if (!nodelist.empty()) args.push_back("--nodelist=" + Join(nodelist, ","));
  if (spread) args.push_back("--distribution=cyclic");  // last: SallocArgs replaces it
  return args;
}

std::vector<std::string> SlurmShape::SallocArgs() const {
  std::vector<std::string> args = SrunArgs();
  if (spread) args.back() = "--spread-job";
  if (min_nodes && nodes && *min_nodes < *nodes) {
    // A node range: as many nodes as Slurm can give, of tasks_per_node tasks each.
    args.erase(args.begin());  // --ntasks
    for (auto& a : args) {
      if (a.rfind("--nodes=", 0) == 0) {
        a = "--nodes=" + std::to_string(*min_nodes) + "-" + std::to_string(*nodes);
      }
    }
  }
  if (no_kill) args.push_back("--no-kill");
  if (signal_s > 0) args.push_back("--signal=USR1@" + std::to_string(signal_s));
  return args;
}

std::string SlurmShape::Describe() const {
  std::string out;
  if (min_nodes && nodes && tasks_per_node && *min_nodes < *nodes) {  // a node range
    out = std::to_string(*min_nodes * *tasks_per_node) + " to " + std::to_string(tasks) +
          " tasks on " + std::to_string(*min_nodes) + " to " + std::to_string(*nodes) + " nodes";
  } else {
    out = std::to_string(tasks) + (tasks == 1 ? " task" : " tasks");
    if (nodes) out += " on " + std::to_string(*nodes) + (*nodes == 1 ? " node" : " nodes");
  }
  if (tasks_per_node) out += ", " + std::to_string(*tasks_per_node) + " per node";
  out += ", " + std::to_string(cpus_per_task) + (cpus_per_task == 1 ? " CPU" : " CPUs");
  if (gpus_per_task > 0) {
    out += " and " + std::to_string(gpus_per_task) + (gpus_per_task == 1 ? " GPU" : " GPUs");
  }
  out += " each";
  if (exclusive) out += ", whole nodes";
  if (!constraint.empty()) out += ", nodes with " + constraint;
  return out;
}

StatusOr<SlurmShape> SlurmShapeFor(const config::ScalingConfig& config,
                                   const accelerators::HostView& env) {
  SlurmShape shape;
  const int n = config.num_workers();
  shape.tasks = n;
  const auto& resources = config.resources_per_worker();
  const bool simulated = Simulated(env);
  if (auto cpu = resources.find("CPU"); cpu != resources.end()) {
    shape.cpus_per_task = std::max(1, static_cast<int>(std::ceil(cpu->second)));
  }
  if (config.use_gpu() && !simulated) {
    double gpus = resources.at("GPU");
    if (gpus != std::floor(gpus)) {
      return InvalidArgumentError(
          "ScalingConfig.resources_per_worker['GPU']=" + std::to_string(gpus) +
          " is not allowed on Slurm, which gives whole GPUs to a task; use a whole number");
    }
    shape.gpus_per_task = static_cast<int>(gpus);
  }
  if (config.use_tpu() && !simulated) {
    // Whole TPU hosts: as many tasks on each as the host's chips hold.
    const auto& slice = config.tpu_slice();
    int per_host = n;
    if (slice && slice->hosts > 0)
      per_host = std::max(1, config.workers_per_slice() / slice->hosts);
    shape.tasks_per_node = std::min(per_host, n);
    shape.nodes = (n + *shape.tasks_per_node - 1) / *shape.tasks_per_node;
    shape.exclusive = true;
  }
  switch (config.placement_strategy()) {
    case config::PlacementStrategy::kStrictSpread:
      shape.nodes = n;
      shape.tasks_per_node = 1;
      break;
    case config::PlacementStrategy::kStrictPack:
      shape.nodes = 1;
      shape.tasks_per_node = n;
      break;
    case config::PlacementStrategy::kSpread: shape.spread = true; break;
    case config::PlacementStrategy::kPack: break;
  }
  JT_ASSIGN_OR_RETURN(std::optional<int> nodes, PositiveSetting(env, kSlurmNodesEnv));
  JT_ASSIGN_OR_RETURN(std::optional<int> per_node, PositiveSetting(env, kSlurmTasksPerNodeEnv));
  if (nodes) {
    shape.nodes = nodes;
    if (!per_node && shape.tasks_per_node && *nodes * *shape.tasks_per_node != n) {
      shape.tasks_per_node.reset();
    }
  }
  if (per_node) shape.tasks_per_node = per_node;
  if (IsTrue(env.GetEnv(kSlurmExclusiveEnv))) shape.exclusive = true;
  if (auto constraint = env.GetEnv(kSlurmConstraintEnv)) shape.constraint = *constraint;
  shape.signal_s = kDefaultSlurmSignalS;
  if (auto signal_s = env.GetEnv(kSlurmSignalEnv); signal_s && !signal_s->empty()) {
    auto v = ParseWhole(*signal_s);
    if (!v || *v > 65535) {
      return InvalidArgumentError(std::string(kSlurmSignalEnv) + "='" + *signal_s +
                                  "' is not allowed; it must be a whole number of seconds from 0 "
                                  "(no signal before the time limit) to 65535");
    }
    shape.signal_s = *v;
  }
  if (shape.nodes && *shape.nodes > n) {
    return InvalidArgumentError(std::string(kSlurmNodesEnv) + "=" + std::to_string(*shape.nodes) +
                                " is more nodes than ScalingConfig.num_workers=" +
                                std::to_string(n) + "; every node must run at least one worker");
  }
  if (shape.nodes && shape.tasks_per_node && *shape.nodes * *shape.tasks_per_node != n) {
    return InvalidArgumentError(
        "the Slurm shape has " + std::to_string(*shape.nodes) + " nodes x " +
        std::to_string(*shape.tasks_per_node) +
        " tasks per node, which is not ScalingConfig.num_workers=" + std::to_string(n) +
        "; change " + kSlurmNodesEnv + " or " + kSlurmTasksPerNodeEnv);
  }
  if (config.elastic()) JT_RETURN_IF_ERROR(ElasticShape(config, &shape));
  return shape;
}

StatusOr<placement::Plan> PlanForSlurm(const config::ScalingConfig& config,
                                       const accelerators::HostView& env) {
  return placement::PlanForScheduler(config, env);
}

StatusOr<placement::Plan> PlanForSlurmNodes(const config::ScalingConfig& config,
                                            const placement::Plan& uniform,
                                            const std::vector<std::string>& nodes,
                                            const SlurmShape& shape, const std::string& job_id) {
  const int min = config.min_workers();
  const int max = config.num_workers();
  const std::string range =
      "ScalingConfig.num_workers=(" + std::to_string(min) + ", " + std::to_string(max) + ")";
  const std::string job = "Slurm job " + job_id + " (nodes " + Join(nodes, ",") + ")";
  if (nodes.empty()) return InvalidArgumentError("Slurm job " + job_id + " has no nodes");
  int per_node = shape.tasks_per_node.value_or(0);
  if (per_node == 0) {
    if (max % static_cast<int>(nodes.size()) != 0) {
      return InvalidArgumentError(range + " is not allowed in " + job +
                                  ": an elastic run on Slurm runs the same number "
                                  "of workers on each node, and " +
                                  std::to_string(nodes.size()) + " nodes do not divide " +
                                  std::to_string(max) + "; set " + kSlurmTasksPerNodeEnv +
                                  ", or allocate a number of "
                                  "nodes that divides max");
    }
    per_node = max / static_cast<int>(nodes.size());
  }
  const int held = std::min(static_cast<int>(nodes.size()), max / per_node);
  if (held * per_node < min) {
    return InvalidArgumentError(range + " is not allowed in " + job + ": its " +
                                std::to_string(held) + " node(s) of " + std::to_string(per_node) +
                                " worker(s) hold fewer than min");
  }
  const std::vector<std::string> used(nodes.begin(), nodes.begin() + held);
  JT_ASSIGN_OR_RETURN(
      placement::Plan full,
      placement::PlanPerHost(uniform, used, per_node, held * per_node,
                             "Slurm job " + job_id + "'s nodes " + Join(used, ",")));
  JT_RETURN_IF_ERROR(placement::CheckElasticHosts(config, full));
  return full;
}

std::map<std::string, SlurmNodeState> ParseSlurmNodes(std::string_view text) {
  std::map<std::string, SlurmNodeState> out;
  auto field = [](const std::string& line, std::string_view name) -> std::string {
    const std::string key = " " + std::string(name) + "=";
    size_t at = (" " + line).find(key);
    if (at == std::string::npos) return "";
    size_t end = line.find(' ', at + key.size() - 1);
    return line.substr(at + key.size() - 1,
                       end == std::string::npos ? std::string::npos : end - at - key.size() + 1);
  };
  for (const std::string& line : SplitLines(text)) {
    std::string name = field(line, "NodeName");
    if (name.empty()) continue;
    SlurmNodeState node{.state = field(line, "State")};
    // Reason=<text, spaces allowed> [user@time]
    if (size_t at = (" " + line).find(" Reason="); at != std::string::npos) {
      std::string reason = line.substr(at + 7);
      size_t mark = reason.find(" [");
      node.reason = Trim(reason.substr(0, mark));
    }
    out[name] = std::move(node);
  }
  return out;
}

bool SlurmNodeUsable(std::string_view state) {
  if (state.empty() || state.find('*') != std::string_view::npos) return false;
  while (!state.empty()) {
    size_t plus = state.find('+');
    std::string_view part = state.substr(0, plus);
    // Leaving, gone or not to be trusted: drained or draining, down, failing, powering down or
    // powered down, rebooting, registered wrongly, or not yet (FUTURE) or no longer known.
    for (std::string_view bad :
         {"DRAIN", "DRAINING", "DRAINED", "DOWN", "NOT_RESPONDING", "FAIL", "FAILING",
          "POWERING_DOWN", "POWER_DOWN", "POWERED_DOWN", "REBOOT_ISSUED", "REBOOT_REQUESTED",
          "INVALID_REG", "FUTURE", "UNKNOWN"}) {
      if (part == bad) return false;
    }
    state = plus == std::string_view::npos ? std::string_view() : state.substr(plus + 1);
  }
  return true;
}

std::optional<TaskEnd> ParseSrunTaskEnd(std::string_view line) {
  constexpr std::string_view kPrefix = "srun: error: ";
  if (line.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string text = Trim(line.substr(kPrefix.size()));
  std::string_view rest = text;
  size_t colon = rest.find(": ");
  if (colon == std::string_view::npos) return std::nullopt;
  TaskEnd end;
  end.node = std::string(rest.substr(0, colon));
  rest.remove_prefix(colon + 2);
  if (rest.substr(0, 6) == "tasks ") {
    rest.remove_prefix(6);
  } else if (rest.substr(0, 5) == "task ") {
    rest.remove_prefix(5);
  } else {
    return std::nullopt;
  }
  colon = rest.find(": ");
  if (colon == std::string_view::npos) return std::nullopt;
  auto tasks = ParseTaskList(rest.substr(0, colon));
  if (!tasks) return std::nullopt;
  end.tasks = std::move(*tasks);
  std::string_view what = rest.substr(colon + 2);
  constexpr std::string_view kExited = "Exited with exit code ";
  if (what.substr(0, kExited.size()) == kExited) {
    auto code = ParseWhole(what.substr(kExited.size()));
    if (!code) return std::nullopt;
    end.exit.exit_code = *code;
    return end;
  }
  constexpr std::string_view kCore = " (core dumped)";
  if (what.size() > kCore.size() && what.substr(what.size() - kCore.size()) == kCore) {
    end.exit.core_dumped = true;
    what.remove_suffix(kCore.size());
  }
  for (int sig = 1; sig < NSIG; ++sig) {
    const char* name = strsignal(sig);
    if (name != nullptr && what == name) {
      end.exit.signal = sig;
      return end;
    }
  }
  return std::nullopt;
}

Status CheckSharedStorage(const std::string& path, const accelerators::HostView& env) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) target = fs::absolute(path);
  std::string declared = env.GetEnv(kSharedStorageEnv).value_or("");
  size_t start = 0;
  while (start <= declared.size()) {
    size_t colon = declared.find(':', start);
    if (colon == std::string::npos) colon = declared.size();
    std::string dir = declared.substr(start, colon - start);
    start = colon + 1;
    if (dir.empty()) continue;
    fs::path shared = fs::weakly_canonical(fs::absolute(dir), ec);
    if (ec) continue;
    auto [end, ignored] = std::mismatch(shared.begin(), shared.end(), target.begin(), target.end());
    if (end == shared.end()) return OkStatus();
  }
  fs::path probe = target;
  struct statfs st {};
  while (statfs(probe.c_str(), &st) != 0) {
    if (!probe.has_parent_path() || probe.parent_path() == probe) {
      return InvalidArgumentError("RunConfig.storage_path '" + path +
                                  "': cannot inspect its filesystem: " + std::strerror(errno));
    }
    probe = probe.parent_path();
  }
  if (IsNetworkFilesystem(st.f_type)) return OkStatus();
  char host[256] = "this host";
  gethostname(host, sizeof(host) - 1);
  return InvalidArgumentError(
      "RunConfig.storage_path '" + path + "' is on a local filesystem (" +
      FilesystemName(st.f_type) + ") of the driver's host (" + host +
      "), but this run's workers are on other hosts, where checkpoints written there cannot be "
      "seen: use shared storage (an NFS or other network filesystem mounted on every node, "
      "s3://, gs://). If this directory is in fact shared with every node, list it in " +
      kSharedStorageEnv);
}

std::optional<int64_t> ParseSlurmTimeLeft(std::string_view raw) {
  const std::string trimmed = Trim(raw);
  std::string_view text = trimmed;
  int64_t days = 0;
  if (size_t dash = text.find('-'); dash != std::string_view::npos) {
    auto d = ParseWhole(text.substr(0, dash));
    if (!d) return std::nullopt;
    days = *d;
    text = text.substr(dash + 1);
  }
  std::vector<int64_t> parts;  // [hours:]minutes:seconds, or hours alone after days
  size_t start = 0;
  for (;;) {
    size_t colon = text.find(':', start);
    auto v =
        ParseWhole(text.substr(start, colon == std::string_view::npos ? colon : colon - start));
    if (!v) return std::nullopt;
    parts.push_back(*v);
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  if (parts.size() > 3 || (parts.size() == 1 && days == 0)) return std::nullopt;
  int64_t seconds = 0;
  if (days > 0 && parts.size() < 3) {  // "1-02" is hours, "1-02:03" hours and minutes
    const int64_t unit[] = {3600, 60};
    for (size_t i = 0; i < parts.size(); ++i) seconds += parts[i] * unit[i];
  } else {
    for (int64_t p : parts) seconds = seconds * 60 + p;
  }
  return days * 86400 + seconds;
}

// --- SlurmAllocation ----------------------------------------------------------------------------

StatusOr<std::unique_ptr<SlurmAllocation>> SlurmAllocation::Current(
    const accelerators::HostView& env) {
  auto job = env.GetEnv("SLURM_JOB_ID");
  if (!job || job->empty()) {
    return FailedPreconditionError("not inside a Slurm allocation (SLURM_JOB_ID is unset)");
  }
  return std::unique_ptr<SlurmAllocation>(new SlurmAllocation(*job, false));
}

StatusOr<std::unique_ptr<SlurmAllocation>> SlurmAllocation::Request(
    const SlurmShape& shape, const std::string& job_name, const std::function<bool()>& cancelled) {
  std::vector<std::string> argv = {"salloc", "--no-shell", "--job-name=" + job_name};
  for (auto& a : shape.SallocArgs()) argv.push_back(a);
  Say("asking Slurm for an allocation: " + shape.Describe());
  JT_ASSIGN_OR_RETURN(Spawned p, Spawn(argv, nullptr, true));
  fcntl(p.output_fd, F_SETFL, fcntl(p.output_fd, F_GETFL) | O_NONBLOCK);
  std::string job_id, partial, said_state, all_output;
  std::chrono::steady_clock::time_point last_check;  // the first check comes at once
  bool open = true;
  while (open) {
    pollfd pfd{p.output_fd, POLLIN, 0};
    poll(&pfd, 1, 200);
    char buf[4096];
    for (;;) {
      ssize_t n = read(p.output_fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;  // EAGAIN
      if (n == 0) {
        open = false;
        break;
      }
      partial.append(buf, static_cast<size_t>(n));
    }
    size_t nl;
    while ((nl = partial.find('\n')) != std::string::npos) {
      std::string line = Trim(partial.substr(0, nl));
      partial.erase(0, nl + 1);
      if (line.empty()) continue;
      all_output += line + "\n";
      Say("slurm: " + line);
      for (std::string_view marker : {"Pending job allocation ", "Granted job allocation "}) {
        size_t at = line.find(marker);
        if (at != std::string::npos && job_id.empty())
          job_id = Trim(line.substr(at + marker.size()));
      }
    }
    if (cancelled()) {
      if (!job_id.empty()) (void)RunCommand({"scancel", "--quiet", job_id});
      kill(p.pid, SIGTERM);
      close(p.output_fd);
      WaitForExit(p.pid);
      return AbortedError("the request for a Slurm allocation" +
                          (job_id.empty() ? std::string() : " (job " + job_id + ")") +
                          " was withdrawn");
    }
    auto now = std::chrono::steady_clock::now();
    if (open && !job_id.empty() && now - last_check >= kReasonPollInterval) {
      last_check = now;
      auto state = RunCommand({"squeue", "--noheader", "--jobs=" + job_id, "--format=%T %r"});
      if (state.ok() && !Trim(*state).empty() && Trim(*state) != said_state &&
          Trim(*state).substr(0, 7) != "RUNNING") {
        said_state = Trim(*state);
        size_t space = said_state.find(' ');
        Say("waiting for Slurm job " + job_id + " (" + shape.Describe() + "): state " +
            said_state.substr(0, space) +
            (space == std::string::npos ? "" : ", reason " + said_state.substr(space + 1)));
      }
    }
  }
  close(p.output_fd);
  ExitStatus exit = WaitForExit(p.pid);
  if (!exit.ok() || job_id.empty()) {
    if (!job_id.empty()) (void)RunCommand({"scancel", "--quiet", job_id});
    return UnavailableError("Slurm did not grant the allocation (salloc " + exit.ToString() +
                            "): " + Trim(all_output));
  }
  Say("Slurm granted job " + job_id);
  return std::unique_ptr<SlurmAllocation>(new SlurmAllocation(job_id, true));
}

SlurmAllocation::~SlurmAllocation() {
  if (!owned_) return;
  auto s = RunCommand({"scancel", "--quiet", job_id_});
  if (!s.ok()) Say("cannot release Slurm job " + job_id_ + ": " + s.status().message());
}

StatusOr<std::vector<std::string>> SlurmAllocation::Nodes() const {
  JT_ASSIGN_OR_RETURN(std::string list,
                      RunCommand({"squeue", "--noheader", "--jobs=" + job_id_, "--format=%N"}));
  list = Trim(list);
  if (list.empty()) return UnavailableError("Slurm lists no nodes for job " + job_id_);
  JT_ASSIGN_OR_RETURN(std::string names, RunCommand({"scontrol", "show", "hostnames", list}));
  return SplitLines(names);
}

StatusOr<std::string> SlurmAllocation::NodeAddress(const std::string& node) const {
  JT_ASSIGN_OR_RETURN(std::string text,
                      RunCommand({"scontrol", "--oneliner", "show", "node", node}));
  size_t at = text.find("NodeAddr=");
  if (at == std::string::npos) return UnavailableError("Slurm shows no NodeAddr for " + node);
  size_t end = text.find_first_of(" \n", at);
  return text.substr(at + 9, end == std::string::npos ? std::string::npos : end - at - 9);
}

// --- SlurmLauncher ------------------------------------------------------------------------------

SlurmLauncher::SlurmLauncher(SlurmLauncherOptions options,
                             std::unique_ptr<SlurmAllocation> allocation)
    : options_(std::move(options)), allocation_(std::move(allocation)) {}

SlurmLauncher::~SlurmLauncher() { EndStandby(); }

StatusOr<SlurmLauncher::Step> SlurmLauncher::StepFor(const std::vector<ProcessSpec>& specs) const {
  JT_ASSIGN_OR_RETURN(UniformGroup group, MergeUniform(specs, kPerRankEnv, "Slurm",
                                                       placement::kPerRankPlacementVariables));
  Step step;
  step.ranks = group.ranks;
  step.secret = group.secret;
  step.env = CurrentEnvironment();
  for (const auto& name : group.unset_env) step.env.erase(name);
  for (const auto& name : kPerRankEnv) step.env.erase(name);
  for (const auto& [k, v] : group.env) step.env[k] = v;
  // The tasks take SIGUSR1 as the time limit's notice, due in this many seconds.
  step.env[kSlurmSignalEnv] = std::to_string(options_.shape.signal_s);
  for (auto& a : StepShape().SrunArgs()) step.args.push_back(a);
  // The secret (or a standby's activation) goes to srun's stdin, which srun hands to every task
  // (--input=all) as their stdin: never in an environment (/proc/PID/environ) or a command line.
  step.args.insert(step.args.end(), {"--kill-on-bad-exit=1", "--export=ALL", "--input=all"});
  // One rank's output needs no labels: the controller reads it as a local process's.
  if (step.ranks.size() > 1) step.args.push_back("--label");
  if (!group.cwd.empty()) step.args.push_back("--chdir=" + group.cwd);
  step.args.insert(step.args.end(), group.argv.begin(), group.argv.end());
  // NUL cannot occur in an argument or a variable: the fields cannot run together.
  for (const auto& a : step.args) step.key += "arg=" + a + '\0';
  for (const auto& [k, v] : step.env) {
    if (!IsActivationName(k)) step.key += "env=" + k + "=" + v + '\0';
  }
  return step;
}

StatusOr<LaunchedProcess> SlurmLauncher::StartStep(Step step, bool standby, int* input) {
  std::vector<std::string> argv = {options_.srun, "--jobid=" + options_.job_id,
                                   "--job-name=" + step.name};
  // A standby step starts while the attempt's step holds the allocation's CPUs.
  if (standby) argv.push_back("--overlap");
  argv.insert(argv.end(), step.args.begin(), step.args.end());
  int in[2] = {-1, -1};
  // The driver's file of the pickled task: the nodes may not see it, so a standby step gets its
  // bytes first on its stdin (python/jaxtrain/worker.py, PRELOAD_ON_PIPE_ENV).
  std::string preload;
  if (auto it = step.env.find(kPreloadFileEnv); it != step.env.end()) {
    if (standby) {
      auto bytes = ReadPreloadFile(it->second, kMaxPreloadBytes);
      if (bytes.ok()) {
        preload = std::move(*bytes);
      } else {
        notes_.push_back("the standby step does not preload the training function (" +
                         bytes.status().message() + ")");
      }
    }
    step.env.erase(it);
  }
  if (standby) {
    for (const char* name : kActivationEnv) step.env.erase(name);
    step.env["JAXTRAIN_STANDBY"] = "1";
    // A step's tasks share its slurmstepd's session, which holds only this step: its standbys
    // may lower the session's priority while they import (python/jaxtrain/worker/entry.py).
    step.env["JAXTRAIN_STANDBY_SESSION"] = "step";
    step.env["JAXTRAIN_RUN_SECRET_FD"] = "0";
    if (!preload.empty()) step.env["JAXTRAIN_PRELOAD_ON_PIPE"] = "1";
    if (pipe2(in, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  } else if (!step.secret.empty()) {
    JT_ASSIGN_OR_RETURN(in[0], PipeHolding(step.secret));
    step.env["JAXTRAIN_RUN_SECRET_FD"] = "0";
  }
  auto spawned = Spawn(argv, &step.env, true, in[0]);
  if (in[0] >= 0) close(in[0]);
  if (!spawned.ok()) {
    if (in[1] >= 0) close(in[1]);
    return spawned.status();
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, spawned->pid, 0));
  if (pidfd < 0) {
    int err = errno;
    if (in[1] >= 0) close(in[1]);
    killpg(spawned->pid, SIGKILL);
    WaitForExit(spawned->pid);
    close(spawned->output_fd);
    return ErrnoError("pidfd_open", err);
  }
  fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  fcntl(spawned->output_fd, F_SETFL, fcntl(spawned->output_fd, F_GETFL) | O_NONBLOCK);
  if (!preload.empty()) {
    // Blocking: srun passes it on as its tasks start (at most kMaxPreloadBytes). A failed write
    // leaves the standbys without it: they read EOF, or an activation that is no length, and
    // the restart then starts a new step.
    std::string frame(8, '\0');
    for (int i = 0; i < 8; ++i)
      frame[i] = static_cast<char>((preload.size() >> (56 - 8 * i)) & 0xff);
    frame += preload;
    if (!WriteAll(in[1], frame).ok()) {
      notes_.push_back("the training function could not be written to the standby step");
    }
  }
  if (input != nullptr) *input = in[1];
  return LaunchedProcess{step.ranks, spawned->pid, pidfd, spawned->output_fd};
}

StatusOr<std::vector<LaunchedProcess>> SlurmLauncher::Launch(
    const std::vector<ProcessSpec>& specs) {
  pgid_ = 0;
  queue_wait_s_ = 0;
  JT_ASSIGN_OR_RETURN(Step step, StepFor(specs));
  if (steps_ > 0) {
    const std::string job = options_.job_id;
    Status renewed = RenewAtTimeLimit();
    if (!renewed.ok() || options_.job_id != job) EndStandby();  // it ran in the old allocation
    JT_RETURN_IF_ERROR(renewed);
  }
  // A step in an allocation that Slurm has ended (node failure, time limit, scancel) can never
  // start: say so once instead of failing every retry.
  auto state =
      RunCommand({options_.squeue, "--noheader", "--jobs=" + options_.job_id, "--format=%T %r"},
                 options_.command_timeout);
  if (!state.ok() && state.status().code() == StatusCode::kDeadlineExceeded) {
    EndStandby();
    return UnavailableError("cannot ask Slurm whether job " + options_.job_id +
                            ", this run's allocation, still runs: " + state.status().message());
  }
  if (!state.ok() || Trim(*state).substr(0, 7) != "RUNNING") {
    EndStandby();
    return FailedPreconditionError(
        "Slurm job " + options_.job_id + ", this run's allocation, is no longer running (" +
        (state.ok() ? (Trim(*state).empty() ? std::string("gone") : Trim(*state))
                    : state.status().message()) +
        "): Slurm ended it (a node failed, its time ran out, or it was cancelled)");
  }

  if (standby_) {
    std::optional<LaunchedProcess> warm = ActivateStandby(step);
    if (warm) return std::vector<LaunchedProcess>{*warm};
  }
  step.name = step_name_ = options_.step_name + "-" + std::to_string(++steps_);
  JT_ASSIGN_OR_RETURN(LaunchedProcess launched, StartStep(std::move(step), false, nullptr));
  pgid_ = launched.pid;
  return std::vector<LaunchedProcess>{launched};
}

std::optional<LaunchedProcess> SlurmLauncher::ActivateStandby(const Step& step) {
  StandbyStep standby = std::move(*standby_);
  standby_.reset();
  std::string why;
  if (standby.key != step.key) {
    why = "was started for another placement";
  } else if (std::optional<ExitStatus> exit = TryReap(standby.process.pid)) {
    why = "is gone (srun " + exit->ToString() + ")";
    standby.process.pid = 0;
  }
  if (why.empty()) {
    const std::string activation = ActivationMessage(step.secret, step.env);
    int err = 0;
    Status written = WriteAll(standby.input, activation, "write", &err);
    close(standby.input);
    standby.input = -1;
    if (written.ok()) {
      step_name_ = standby.name;
      pgid_ = standby.process.pid;
      details_.push_back("ranks " + RanksText(step.ranks) + " started from a standby step (" +
                         standby.name + ", already past import jax)");
      return standby.process;
    }
    why = std::string("could not be activated (") + std::strerror(err) + ")";
  }
  notes_.push_back("the standby step " + standby.name + " " + why + "; starting a new step");
  standby_ = std::move(standby);
  EndStandby();
  return std::nullopt;
}

Status SlurmLauncher::PrepareNext(const std::vector<ProcessSpec>& specs) {
  if (!options_.warm || standby_ || interrupted_.load()) return OkStatus();
  JT_ASSIGN_OR_RETURN(Step step, StepFor(specs));
  StandbyStep standby{.key = step.key, .name = options_.step_name + "-" + std::to_string(++steps_)};
  step.name = standby.name;
  JT_ASSIGN_OR_RETURN(standby.process, StartStep(std::move(step), true, &standby.input));
  standby_ = std::move(standby);
  return OkStatus();
}

void SlurmLauncher::EndStandby() {
  if (!standby_) return;
  StandbyStep standby = std::move(*standby_);
  standby_.reset();
  if (standby.input >= 0) close(standby.input);  // its tasks read EOF and exit 0
  if (standby.process.pid > 0) {
    // srun ends once its tasks have; one that does not soon is killed, and its step cancelled
    // (a killed srun leaves its tasks running).
    std::optional<ExitStatus> exit;
    for (int i = 0; i < 50 && !(exit = TryReap(standby.process.pid)); ++i) usleep(100 * 1000);
    if (!exit) {
      killpg(standby.process.pid, SIGKILL);
      WaitForExit(standby.process.pid);
      CancelStep(standby.name);
    }
  }
  if (standby.process.pidfd >= 0) close(standby.process.pidfd);
  if (standby.process.output_fd >= 0) close(standby.process.output_fd);
}

void SlurmLauncher::EndRun(bool) { EndStandby(); }

std::vector<std::string> SlurmLauncher::TakeNotes() { return std::exchange(notes_, {}); }

std::vector<std::string> SlurmLauncher::TakeDetails() { return std::exchange(details_, {}); }

Status SlurmLauncher::RenewAtTimeLimit() {
  if (allocation_ == nullptr || !allocation_->owned() || options_.shape.signal_s <= 0) {
    return OkStatus();
  }
  auto text =
      RunCommand({options_.squeue, "--noheader", "--jobs=" + options_.job_id, "--format=%L"},
                 options_.command_timeout);
  if (!text.ok()) return OkStatus();  // the state check after it says what is wrong
  std::optional<int64_t> left = ParseSlurmTimeLeft(*text);
  if (!left || *left > options_.shape.signal_s + kSlurmSignalSlackS) return OkStatus();
  Say("Slurm job " + options_.job_id + ", this run's allocation, reaches its time limit in " +
      std::to_string(*left) + " s (its time-limit notice, --signal=USR1@" +
      std::to_string(options_.shape.signal_s) +
      ", is due): releasing it and asking Slurm for a new allocation of the same shape; the run "
      "resumes there from its latest checkpoint");
  allocation_.reset();  // scancel: its nodes are free for the new request
  const auto asked = std::chrono::steady_clock::now();
  auto renewed = SlurmAllocation::Request(options_.shape, options_.step_name,
                                          [this] { return interrupted_.load(); });
  queue_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
  if (!renewed.ok()) {
    if (renewed.status().code() == StatusCode::kAborted) {
      return CancelledError(renewed.status().message());
    }
    return renewed.status();
  }
  allocation_ = std::move(*renewed);
  options_.job_id = allocation_->job_id();
  if (step_shape_ && !step_shape_->nodelist.empty()) {
    // An elastic run's nodes were the old allocation's: its steps now run on any of the new one.
    step_shape_->nodelist.clear();
    notes_.push_back("the new allocation has nodes of its own: the steps run on " +
                     std::to_string(step_shape_->nodes.value_or(0)) + " of them, chosen by Slurm");
  }
  return OkStatus();
}

// --- elastic runs -------------------------------------------------------------------------------

StatusOr<std::vector<std::string>> SlurmLauncher::UnusableNodes(
    const std::vector<std::string>& hosts, int cancel_fd, bool if_unknown) {
  if (interrupted_.load()) return CancelledError("the run is being stopped");
  if (hosts.empty()) return std::vector<std::string>{};
  auto text = RunCommand({options_.scontrol, "--oneliner", "show", "node", Join(hosts, ",")},
                         options_.command_timeout, cancel_fd);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kCancelled) return text.status();
    return if_unknown ? hosts : std::vector<std::string>{};
  }
  const std::map<std::string, SlurmNodeState> states = ParseSlurmNodes(*text);
  std::vector<std::string> unusable;
  MutexLock lock(states_mu_);
  for (const std::string& host : hosts) {
    auto it = states.find(host);
    const std::string state = it == states.end() ? "not known to Slurm" : it->second.state;
    const bool usable = it != states.end() && SlurmNodeUsable(state);
    if (!usable) unusable.push_back(host);
    // Said when it changes: a node drained, down or back.
    if (said_states_[host] == state) continue;
    const bool was_usable = said_states_[host].empty() || SlurmNodeUsable(said_states_[host]);
    said_states_[host] = state;
    if (!usable) {
      Say("Slurm node " + host + " is " + state +
          (it != states.end() && !it->second.reason.empty() ? " (reason: " + it->second.reason + ")"
                                                            : "") +
          ": the run's steps leave it out until it is usable again");
    } else if (!was_usable) {
      Say("Slurm node " + host + " is usable again (" + state + ")");
    }
  }
  return unusable;
}

StatusOr<std::vector<std::string>> SlurmLauncher::UnreachableHosts(
    const std::vector<std::string>& hosts, Duration wait, int cancel_fd) {
  return ProbeUntil([&] { return UnusableNodes(hosts, cancel_fd, /*if_unknown=*/true); }, wait,
                    cancel_fd, interrupted_);
}

StatusOr<std::vector<std::string>> SlurmLauncher::LeavingHosts(
    const std::vector<std::string>& hosts, int cancel_fd) {
  return UnusableNodes(hosts, cancel_fd, /*if_unknown=*/false);
}

Status SlurmLauncher::UsePlan(const placement::Plan& plan) {
  std::vector<std::string> nodes;
  std::map<std::string, int> ranks;
  for (const placement::WorkerPlacement& w : plan.workers) {
    if (w.host.empty()) {
      return InvalidArgumentError("rank " + std::to_string(w.rank) +
                                  " of the plan is on no Slurm node");
    }
    if (ranks[w.host]++ == 0) nodes.push_back(w.host);
  }
  if (nodes.empty()) return InvalidArgumentError("the plan has no rank");
  const int per_node = ranks[nodes.front()];
  for (const auto& node : nodes) {
    if (ranks[node] != per_node) {
      return InvalidArgumentError("the plan puts " + std::to_string(ranks[node]) +
                                  " rank(s) on Slurm node " + node + " and " +
                                  std::to_string(per_node) + " on " + nodes.front() +
                                  "; a step runs the same number on each node");
    }
  }
  SlurmShape step = options_.shape;
  step.tasks = static_cast<int>(plan.workers.size());
  step.nodes = static_cast<int>(nodes.size());
  step.tasks_per_node = per_node;
  step.min_nodes.reset();
  step.nodelist = std::move(nodes);
  step.spread = false;  // ranks in blocks per node, as the plan numbers them
  step_shape_ = std::move(step);
  return OkStatus();
}

Status SlurmLauncher::SignalGroup(int signal) {
  Status s = pgid_ > 0 ? SignalProcessGroup(pgid_, signal) : OkStatus();
  if (signal == SIGKILL) CancelStep(step_name_);  // notes what it cannot do
  return s;
}

void SlurmLauncher::CancelStep(const std::string& name) {
  if (name.empty()) return;
  auto steps = RunCommand(
      {options_.squeue, "--noheader", "--steps", "--jobs=" + options_.job_id, "--format=%i|%j"},
      options_.command_timeout);
  if (!steps.ok()) {
    notes_.push_back("cannot find the job step to cancel: " + steps.status().message());
    return;
  }
  for (const auto& line : SplitLines(*steps)) {
    size_t bar = line.find('|');
    if (bar == std::string::npos || line.substr(bar + 1) != name) continue;
    auto s =
        RunCommand({options_.scancel, "--quiet", line.substr(0, bar)}, options_.command_timeout);
    if (!s.ok()) {
      notes_.push_back("cannot cancel job step " + line.substr(0, bar) + ": " +
                       s.status().message());
    }
  }
}

StatusOr<SlurmStart> StartSlurm(const config::ScalingConfig& config,
                                const accelerators::HostView& env, const std::string& step_name,
                                const std::function<bool()>& cancelled) {
  JT_ASSIGN_OR_RETURN(SlurmShape shape, SlurmShapeFor(config, env));
  std::unique_ptr<SlurmAllocation> allocation;
  if (auto job = env.GetEnv("SLURM_JOB_ID"); job && !job->empty()) {
    JT_ASSIGN_OR_RETURN(allocation, SlurmAllocation::Current(env));
  } else {
    JT_ASSIGN_OR_RETURN(allocation, SlurmAllocation::Request(shape, step_name, cancelled));
  }
  std::string host = env.GetEnv(kListenHostEnv).value_or("");
  if (host.empty()) {
    StatusOr<std::string> chosen = [&]() -> StatusOr<std::string> {
      JT_ASSIGN_OR_RETURN(std::vector<std::string> nodes, allocation->Nodes());
      JT_ASSIGN_OR_RETURN(std::string address, allocation->NodeAddress(nodes.front()));
      return AddressTowards(address);
    }();
    if (!chosen.ok()) {
      return UnavailableError("cannot choose the address the Slurm nodes reach this driver at: " +
                              chosen.status().message() + "; set " + kListenHostEnv);
    }
    host = *chosen;
  }
  std::string job_id = allocation->job_id();
  std::vector<std::string> nodes;
  if (config.elastic()) {
    JT_ASSIGN_OR_RETURN(nodes, allocation->Nodes());
  }
  JT_ASSIGN_OR_RETURN(const bool warm, WarmWorkersRequested());
  return SlurmStart{.launcher = std::make_unique<SlurmLauncher>(
                        SlurmLauncherOptions{
                            .job_id = job_id, .shape = shape, .step_name = step_name, .warm = warm},
                        std::move(allocation)),
                    .listen_host = std::move(host),
                    .nodes = std::move(nodes),
                    .job_id = job_id,
                    .shape = shape};
}

}  // namespace jaxtrain::launch
