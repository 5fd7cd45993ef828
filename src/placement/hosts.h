// Host descriptions: the machines a plan is made for, with their CPUs, GPUs and TPU chips, and
// the TPU slice each TPU host belongs to. A description comes from one of three places:
//   * this machine's discovery (DescribeThisHost), the default;
//   * a JSON file named by JAXTRAIN_HOSTS (ParseHostDescription; the format is documented in
//     docs/accelerators.md), which describes hosts this machine does not have;
//   * the simulate switch without a file: the smallest set of hosts that fits the ScalingConfig
//     (SimulatedHosts).
// Placement treats all three alike. Plain values and pure functions; thread-safe.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "accelerators/discovery.h"
#include "base/status.h"
#include "config/scaling_config.h"

namespace jaxtrain::placement {

// Names a JSON host description file; placement then plans for the hosts it lists.
inline constexpr char kHostsEnv[] = "JAXTRAIN_HOSTS";

// The driver's environment, which every worker inherits: name -> value.
using Environment = std::map<std::string, std::string>;

struct Host {
  std::string name;     // unique within a description
  std::string address;  // how the other hosts reach it (TPU_WORKER_HOSTNAMES, MEGASCALE_...)
  bool local = false;   // this machine: the local launcher can start its workers
  int cpus = 0;         // limits the workers it takes (resources_per_worker["CPU"]); 0: no limit
  // GPUs as a worker's CUDA_VISIBLE_DEVICES names them, in order: already mapped through the
  // inherited CUDA_VISIBLE_DEVICES.
  std::vector<std::string> gpus;
  int tpu_chips = 0;
  // The TPU slice the host belongs to (TPU_NAME), its index in it (TPU_WORKER_ID), and the
  // slice's pod type and topology when known (empty: unknown). A TPU host described without a
  // slice is a single-host slice named after the host.
  std::string tpu_slice;
  int tpu_worker_id = 0;
  std::string tpu_accelerator_type;
  std::string tpu_topology;
};

struct HostDescription {
  std::string source;  // names it in messages: "this machine", "JAXTRAIN_HOSTS=/x/hosts.json"
  std::vector<Host> hosts;
};

// Checks that `name` can stand as one word on a command line that starts a process on the host
// (an ssh target: "host" or "user@host"): not empty, not beginning with '-' (ssh would read it as
// an option, e.g. -oProxyCommand=...), and without whitespace or control characters.
// Errors: kInvalidArgument "<where>: host name "<name>" is not allowed: ...", saying what is.
Status CheckHostName(std::string_view name, const std::string& where);

// This machine: its TPU chips and TPU identity (TPU_NAME, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE,
// TPU_TOPOLOGY), its visible GPUs; address "localhost"; its CPUs are not a limit (local workers
// may share cores).
HostDescription DescribeThisHost(const accelerators::HostView& host);

// Parses a JSON host description. `inherited` supplies CUDA_VISIBLE_DEVICES, which maps every
// host's GPUs as it maps this machine's (workers inherit the driver's environment). A host is
// `local` when its name is `local_host_name` or its address is a loopback one.
// Errors: kInvalidArgument naming `source`, the host and the field: malformed JSON, an unknown
// key, a missing or mistyped value, a name or address that CheckHostName refuses, a duplicate
// host name or slice worker id, hosts of one slice
// that disagree on its accelerator_type or topology, an unknown TPU generation.
StatusOr<HostDescription> ParseHostDescription(std::string_view json, std::string source,
                                               const Environment& inherited,
                                               std::string_view local_host_name);

// Reads and parses the file at `path` through `host`.
// Errors: kNotFound when it cannot be read; those of ParseHostDescription.
StatusOr<HostDescription> LoadHostDescription(const accelerators::HostView& host,
                                              const std::string& path,
                                              const Environment& inherited);

// For the simulate switch without a description: the hosts `config` needs. TPU with a topology:
// num_slices whole slices "sim-slice-<s>" of hosts "sim-slice-<s>-host-<w>"; TPU without one:
// one host with the chips the worker asks for (resources_per_worker["TPU"]), or 4; GPU: one host
// with every GPU (PACK, STRICT_PACK) or one host per worker (SPREAD, STRICT_SPREAD). Call only with
// use_tpu or use_gpu.
HostDescription SimulatedHosts(const config::ScalingConfig& config);

}  // namespace jaxtrain::placement
