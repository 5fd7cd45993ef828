#include "placement/hosts.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>

#include "accelerators/tpu.h"

namespace jaxtrain::placement {
namespace {

using nlohmann::json;

constexpr std::string_view kLoopbackAddresses[] = {"localhost", "127.0.0.1", "::1"};

// Reads one JSON object's fields, naming where it is in every error.
class Fields {
 public:
  Fields(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  Status OnlyKnown(std::initializer_list<std::string_view> known) const {
    for (const auto& [key, value] : object_.items()) {
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string allowed;
        for (std::string_view k : known) allowed += (allowed.empty() ? "" : ", ") + std::string(k);
        return InvalidArgumentError(where_ + ": unknown key \"" + key + "\"; allowed: " + allowed);
      }
    }
    return OkStatus();
  }

  StatusOr<std::optional<std::string>> String(const std::string& key) const {
    if (!object_.contains(key)) return std::optional<std::string>();
    const json& v = object_.at(key);
    if (!v.is_string() || v.get<std::string>().empty()) {
      return InvalidArgumentError(where_ + ": \"" + key + "\" is " + v.dump() +
                                  "; it must be a non-empty string");
    }
    return std::optional<std::string>(v.get<std::string>());
  }

  StatusOr<std::optional<int>> Int(const std::string& key, int min) const {
    if (!object_.contains(key)) return std::optional<int>();
    const json& v = object_.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < min || v.get<int64_t>() > 1'000'000) {
      return InvalidArgumentError(where_ + ": \"" + key + "\" is " + v.dump() +
                                  "; it must be a whole number >= " + std::to_string(min));
    }
    return std::optional<int>(static_cast<int>(v.get<int64_t>()));
  }

  const std::string& where() const { return where_; }

 private:
  const json& object_;
  std::string where_;
};

bool IsLoopback(std::string_view address) {
  return std::find(std::begin(kLoopbackAddresses), std::end(kLoopbackAddresses), address) !=
         std::end(kLoopbackAddresses);
}

std::optional<std::string> Get(const Environment& env, const std::string& name) {
  const auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

StatusOr<Host> ParseHost(const json& entry, const std::string& where, const Environment& inherited,
                         std::string_view local_host_name, bool* tpu_worker_id_given) {
  if (!entry.is_object()) {
    return InvalidArgumentError(where + " is " + entry.dump() +
                                "; each host is an object such as {\"name\": \"host-0\"}");
  }
  Host host;
  JT_ASSIGN_OR_RETURN(const std::optional<std::string> name, Fields(entry, where).String("name"));
  if (!name) return InvalidArgumentError(where + " has no \"name\"; every host needs one");
  host.name = *name;
  JT_RETURN_IF_ERROR(CheckHostName(host.name, where + " \"name\""));
  const Fields named(entry, where + " (\"" + host.name + "\")");
  JT_RETURN_IF_ERROR(named.OnlyKnown({"name", "address", "cpus", "gpus", "tpu"}));
  JT_ASSIGN_OR_RETURN(const std::optional<std::string> address, named.String("address"));
  host.address = address.value_or(host.name);
  JT_RETURN_IF_ERROR(CheckHostName(host.address, named.where() + " \"address\""));
  host.local = host.name == local_host_name || IsLoopback(host.address);
  JT_ASSIGN_OR_RETURN(const std::optional<int> cpus, named.Int("cpus", 1));
  host.cpus = cpus.value_or(0);
  JT_ASSIGN_OR_RETURN(const std::optional<int> gpus, named.Int("gpus", 0));
  std::vector<int> present(static_cast<size_t>(gpus.value_or(0)));
  for (size_t i = 0; i < present.size(); ++i) present[i] = static_cast<int>(i);
  host.gpus = accelerators::MapCudaVisibleDevices(present, Get(inherited, "CUDA_VISIBLE_DEVICES"));

  *tpu_worker_id_given = false;
  if (!entry.contains("tpu")) return host;
  const json& tpu = entry.at("tpu");
  const std::string tpu_where = named.where() + ".tpu";
  if (!tpu.is_object()) {
    return InvalidArgumentError(tpu_where + " is " + tpu.dump() +
                                "; it must be an object such as {\"chips\": 4}");
  }
  const Fields tpu_fields(tpu, tpu_where);
  JT_RETURN_IF_ERROR(
      tpu_fields.OnlyKnown({"chips", "slice", "worker_id", "accelerator_type", "topology"}));
  JT_ASSIGN_OR_RETURN(const std::optional<int> chips, tpu_fields.Int("chips", 1));
  if (!chips) return InvalidArgumentError(tpu_where + " has no \"chips\"; give the chip count");
  host.tpu_chips = *chips;
  JT_ASSIGN_OR_RETURN(const std::optional<std::string> slice, tpu_fields.String("slice"));
  host.tpu_slice = slice.value_or(host.name);
  JT_ASSIGN_OR_RETURN(const std::optional<int> worker_id, tpu_fields.Int("worker_id", 0));
  host.tpu_worker_id = worker_id.value_or(0);
  *tpu_worker_id_given = worker_id.has_value();
  JT_ASSIGN_OR_RETURN(const std::optional<std::string> type, tpu_fields.String("accelerator_type"));
  JT_ASSIGN_OR_RETURN(const std::optional<std::string> topology, tpu_fields.String("topology"));
  if (type && topology) {
    const StatusOr<accelerators::TpuSlice> described =
        accelerators::DescribeSlice(*type, *topology);
    if (!described.ok()) {
      return InvalidArgumentError(tpu_where + ": " + described.status().message());
    }
    host.tpu_accelerator_type = described->pod_type;
    host.tpu_topology = described->topology;
  } else if (type) {
    const Status parsed = accelerators::ParseTpuGeneration(*type).status();
    if (!parsed.ok()) return InvalidArgumentError(tpu_where + ": " + parsed.message());
    host.tpu_accelerator_type = *type;
  } else if (topology) {
    host.tpu_topology = *topology;
  }
  return host;
}

// Every host of a slice has its own worker id, and they agree on what the slice is.
Status CheckSlices(const HostDescription& description, const std::vector<bool>& worker_id_given) {
  std::map<std::string, std::vector<size_t>> slices;
  for (size_t i = 0; i < description.hosts.size(); ++i) {
    if (description.hosts[i].tpu_chips > 0) slices[description.hosts[i].tpu_slice].push_back(i);
  }
  for (const auto& [slice, members] : slices) {
    std::map<int, std::string> by_worker_id;
    const Host& first = description.hosts[members.front()];
    for (size_t i : members) {
      const Host& host = description.hosts[i];
      const std::string where =
          description.source + ": host \"" + host.name + "\" of TPU slice \"" + slice + "\"";
      if (members.size() > 1 && !worker_id_given[i]) {
        return InvalidArgumentError(where + " has no tpu.worker_id; the slice has " +
                                    std::to_string(members.size()) +
                                    " hosts, so each needs its index in it (0, 1, ...)");
      }
      const auto [it, inserted] = by_worker_id.emplace(host.tpu_worker_id, host.name);
      if (!inserted) {
        return InvalidArgumentError(where + " has tpu.worker_id " +
                                    std::to_string(host.tpu_worker_id) + ", as host \"" +
                                    it->second + "\" does; worker ids in a slice are distinct");
      }
      if (host.tpu_accelerator_type != first.tpu_accelerator_type ||
          host.tpu_topology != first.tpu_topology) {
        return InvalidArgumentError(where + " says accelerator_type='" + host.tpu_accelerator_type +
                                    "', topology='" + host.tpu_topology + "', but host \"" +
                                    first.name + "\" says '" + first.tpu_accelerator_type + "', '" +
                                    first.tpu_topology +
                                    "'; every host of a slice gives the same values");
      }
    }
  }
  return OkStatus();
}

}  // namespace

HostDescription DescribeThisHost(const accelerators::HostView& view) {
  Host host;
  host.name = view.HostName();
  host.address = "localhost";
  host.local = true;
  host.gpus = accelerators::VisibleGpus(view);
  host.tpu_chips = accelerators::CountTpuChips(view);
  if (host.tpu_chips > 0) {
    const accelerators::TpuHostIdentity identity = accelerators::ReadTpuHostIdentity(view);
    host.tpu_slice = identity.name.empty() ? host.name : identity.name;
    host.tpu_worker_id = identity.worker_id.value_or(0);
    host.tpu_accelerator_type = identity.accelerator_type;
    host.tpu_topology = identity.topology;
  }
  return {.source = "this machine", .hosts = {std::move(host)}};
}

Status CheckHostName(std::string_view name, const std::string& where) {
  std::string why;
  if (name.empty()) {
    why = "it is empty";
  } else if (name.front() == '-') {
    why = "it begins with '-', which ssh would read as an option";
  } else {
    for (unsigned char c : name) {
      if (c <= ' ' || c == 0x7f) {
        why = "it holds whitespace or a control character";
        break;
      }
    }
  }
  if (why.empty()) return OkStatus();
  nlohmann::json shown = std::string(name);
  return InvalidArgumentError(
      where + ": host name " + shown.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace) +
      " is not allowed: " + why +
      "; a host is named by a host name or address, optionally as user@host, that does "
      "not begin with '-' and holds no whitespace or control characters");
}

StatusOr<HostDescription> ParseHostDescription(std::string_view text, std::string source,
                                               const Environment& inherited,
                                               std::string_view local_host_name) {
  json document;
  try {
    document = json::parse(text);
  } catch (const json::parse_error& e) {
    return InvalidArgumentError(source + " is not valid JSON: " + e.what());
  }
  const std::string example =
      "; a host description is {\"hosts\": [{\"name\": \"host-0\", ...}, ...]} (see "
      "docs/accelerators.md)";
  if (!document.is_object() || !document.contains("hosts") || !document["hosts"].is_array() ||
      document["hosts"].empty()) {
    return InvalidArgumentError(source + " has no list of hosts" + example);
  }
  JT_RETURN_IF_ERROR(Fields(document, source).OnlyKnown({"hosts"}));
  HostDescription description;
  description.source = std::move(source);
  std::vector<bool> worker_id_given;
  std::set<std::string> names;
  const json& hosts = document["hosts"];
  for (size_t i = 0; i < hosts.size(); ++i) {
    bool given = false;
    JT_ASSIGN_OR_RETURN(
        Host host, ParseHost(hosts[i], description.source + ": hosts[" + std::to_string(i) + "]",
                             inherited, local_host_name, &given));
    if (!names.insert(host.name).second) {
      return InvalidArgumentError(description.source + ": host name \"" + host.name +
                                  "\" appears twice; host names are distinct");
    }
    worker_id_given.push_back(given);
    description.hosts.push_back(std::move(host));
  }
  JT_RETURN_IF_ERROR(CheckSlices(description, worker_id_given));
  return description;
}

StatusOr<HostDescription> LoadHostDescription(const accelerators::HostView& host,
                                              const std::string& path,
                                              const Environment& inherited) {
  const std::string source = std::string(kHostsEnv) + "=" + path;
  const std::optional<std::string> text = host.ReadFile(path);
  if (!text) {
    return NotFoundError(source + " cannot be read; point " + kHostsEnv +
                         " at a JSON host description (see docs/accelerators.md), or unset it");
  }
  return ParseHostDescription(*text, source, inherited, host.HostName());
}

HostDescription SimulatedHosts(const config::ScalingConfig& config) {
  HostDescription description{.source = "the simulated hosts", .hosts = {}};
  const auto add = [&](std::string name) -> Host& {
    Host& host = description.hosts.emplace_back();
    host.address = name;
    host.name = std::move(name);
    return host;
  };
  const int n = config.num_workers();
  if (config.use_tpu()) {
    if (const auto& slice = config.tpu_slice()) {
      for (int s = 0; s < config.num_slices(); ++s) {
        const std::string slice_name = "sim-slice-" + std::to_string(s);
        for (int w = 0; w < slice->hosts; ++w) {
          Host& host = add(slice_name + "-host-" + std::to_string(w));
          host.tpu_chips = slice->chips_per_host;
          host.tpu_slice = slice_name;
          host.tpu_worker_id = w;
          host.tpu_accelerator_type = slice->pod_type;
          host.tpu_topology = slice->topology;
        }
      }
    } else {
      // A worker takes the chips it asks for, or a whole host of the usual 4 chips.
      const auto& asked = config.input().resources_per_worker;
      const auto chips = asked.find("TPU");
      Host& host = add("sim-host-0");
      host.tpu_chips = chips == asked.end() ? 4 : std::max(1, static_cast<int>(chips->second));
      host.tpu_slice = host.name;
    }
    return description;
  }
  const int per_worker = std::max(1, static_cast<int>(config.resources_per_worker().at("GPU")));
  const bool spread = config.placement_strategy() == config::PlacementStrategy::kSpread ||
                      config.placement_strategy() == config::PlacementStrategy::kStrictSpread;
  const int hosts = spread ? n : 1;
  for (int h = 0; h < hosts; ++h) {
    Host& host = add("sim-host-" + std::to_string(h));
    for (int g = 0; g < per_worker * (n / hosts); ++g) host.gpus.push_back(std::to_string(g));
  }
  return description;
}

}  // namespace jaxtrain::placement
