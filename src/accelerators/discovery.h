// What accelerators this host has. Every probe reads the machine through HostView, so tests
// describe a host that this machine is not. Thread-safe as long as the HostView is.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace jaxtrain::accelerators {

// The parts of a machine that discovery reads.
class HostView {
 public:
  virtual ~HostView() = default;
  // Entry names of a directory (not recursive); empty when it does not exist.
  virtual std::vector<std::string> ListDir(const std::string& path) const = 0;
  virtual bool IsCharDevice(const std::string& path) const = 0;
  virtual bool IsDirectory(const std::string& path) const = 0;
  // Whole contents of a small file, or nullopt when it cannot be read.
  virtual std::optional<std::string> ReadFile(const std::string& path) const = 0;
  virtual std::optional<std::string> GetEnv(const std::string& name) const = 0;
  virtual int CpuCount() const = 0;
  // This machine's host name (gethostname).
  virtual std::string HostName() const = 0;
};

// The real machine.
const HostView& RealHost();

// An in-memory host for tests.
class FakeHost : public HostView {
 public:
  std::map<std::string, std::string> files;  // path -> contents
  std::vector<std::string> char_devices;     // paths
  std::vector<std::string> directories;      // paths
  std::map<std::string, std::string> env;
  int cpus = 2;
  std::string hostname = "fake-host";

  std::vector<std::string> ListDir(const std::string& path) const override;
  bool IsCharDevice(const std::string& path) const override;
  bool IsDirectory(const std::string& path) const override;
  std::optional<std::string> ReadFile(const std::string& path) const override;
  std::optional<std::string> GetEnv(const std::string& name) const override;
  int CpuCount() const override { return cpus; }
  std::string HostName() const override { return hostname; }
};

// TPU chips: the number of /dev/accel<N> character devices (directories such as NVIDIA's
// /dev/accel/ are skipped); failing that, /dev/vfio/<N> IOMMU groups whose device's PCI vendor
// (/sys/kernel/iommu_groups/<N>/devices/*/vendor) is Google's 0x1ae0.
int CountTpuChips(const HostView& host);

// NVIDIA GPUs usable by this process: /dev/nvidia<N> devices, narrowed and ordered by an
// inherited CUDA_VISIBLE_DEVICES when it is set (its entries are returned as given).
std::vector<std::string> VisibleGpus(const HostView& host);

// The GPUs a process sees on a host whose devices have the indices `present` (ascending) when it
// inherits `cuda_visible_devices` (nullopt: unset), read as CUDA reads it: entries are device
// indices or "GPU-"/"MIG-" UUIDs, and the first entry that is neither a present device nor a UUID
// hides itself and every entry after it ("-1" hides all GPUs). Entries are returned as given.
std::vector<std::string> MapCudaVisibleDevices(
    const std::vector<int>& present, const std::optional<std::string>& cuda_visible_devices);

// TPU identity provided by GKE and TPU VMs through the environment; fields are empty when unset.
struct TpuHostIdentity {
  std::string name;              // TPU_NAME
  std::optional<int> worker_id;  // TPU_WORKER_ID
  std::string accelerator_type;  // TPU_ACCELERATOR_TYPE, e.g. "v6e-16"
  std::string topology;          // TPU_TOPOLOGY, e.g. "4x4"
};
TpuHostIdentity ReadTpuHostIdentity(const HostView& host);

}  // namespace jaxtrain::accelerators
