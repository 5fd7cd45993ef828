#include "accelerators/discovery.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <set>
#include <string_view>
#include <thread>

namespace jaxtrain::accelerators {
namespace {

// Google's PCI vendor id, as sysfs spells it.
constexpr std::string_view kGooglePciVendor = "0x1ae0";

std::string_view Trim(std::string_view text) {
  const auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

std::vector<std::string_view> SplitCommas(std::string_view text) {
  std::vector<std::string_view> parts;
  while (true) {
    const size_t comma = text.find(',');
    parts.push_back(text.substr(0, comma));
    if (comma == std::string_view::npos) return parts;
    text.remove_prefix(comma + 1);
  }
}

// A non-negative decimal number written with digits only (no sign, no spaces).
std::optional<int> ParseIndex(std::string_view text) {
  if (text.empty() || !std::all_of(text.begin(), text.end(), [](char c) {
        return std::isdigit(static_cast<unsigned char>(c)) != 0;
      })) {
    return std::nullopt;
  }
  int index = 0;
  if (std::from_chars(text.data(), text.data() + text.size(), index).ec != std::errc()) {
    return std::nullopt;
  }
  return index;
}

// N for a device entry named `prefix` followed by N, e.g. ("accel3", "accel") -> 3.
std::optional<int> IndexAfterPrefix(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix)) return std::nullopt;
  return ParseIndex(name.substr(prefix.size()));
}

// Indices N of the /dev/<prefix>N character devices, ascending.
std::vector<int> DeviceIndices(const HostView& host, std::string_view prefix) {
  std::vector<int> indices;
  for (const std::string& name : host.ListDir("/dev")) {
    const std::optional<int> index = IndexAfterPrefix(name, prefix);
    if (index.has_value() && host.IsCharDevice("/dev/" + name)) indices.push_back(*index);
  }
  std::sort(indices.begin(), indices.end());
  return indices;
}

// A VFIO group is a TPU when one of its PCI devices is Google's. Any PCI device bound to vfio-pci
// appears under /dev/vfio (NVIDIA BlueField's management interface, for one), so the group number
// alone says nothing.
bool IsTpuIommuGroup(const HostView& host, const std::string& group) {
  const std::string devices = "/sys/kernel/iommu_groups/" + group + "/devices";
  for (const std::string& device : host.ListDir(devices)) {
    const std::optional<std::string> vendor = host.ReadFile(devices + "/" + device + "/vendor");
    if (!vendor.has_value()) continue;
    std::string spelled(Trim(*vendor));
    std::transform(spelled.begin(), spelled.end(), spelled.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (spelled == kGooglePciVendor) return true;
  }
  return false;
}

class RealHostView : public HostView {
 public:
  // Sorted, so that callers see the same order on every call.
  std::vector<std::string> ListDir(const std::string& path) const override {
    std::vector<std::string> names;
    DIR* dir = opendir(path.c_str());
    if (dir == nullptr) return names;
    while (const dirent* entry = readdir(dir)) {
      const std::string_view name = entry->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
    }
    closedir(dir);
    std::sort(names.begin(), names.end());
    return names;
  }

  bool IsCharDevice(const std::string& path) const override {
    struct stat info;
    return stat(path.c_str(), &info) == 0 && S_ISCHR(info.st_mode);
  }

  bool IsDirectory(const std::string& path) const override {
    struct stat info;
    return stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  }

  // Reads to end of file rather than trusting st_size, which sysfs reports as 4096.
  std::optional<std::string> ReadFile(const std::string& path) const override {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    std::string contents;
    char buffer[4096];
    while (true) {
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n == 0) break;
      if (n < 0) {
        if (errno == EINTR) continue;
        close(fd);
        return std::nullopt;
      }
      contents.append(buffer, static_cast<size_t>(n));
    }
    close(fd);
    return contents;
  }

  std::optional<std::string> GetEnv(const std::string& name) const override {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  }

  // The CPUs this process may run on (taskset, cpuset cgroups), not the machine's total.
  int CpuCount() const override {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
      return CPU_COUNT(&allowed);
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }

  std::string HostName() const override {
    char name[HOST_NAME_MAX + 1] = {};
    if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
    return name;
  }
};

}  // namespace

const HostView& RealHost() {
  static const auto* const kHost = new RealHostView();
  return *kHost;
}

// A path the fake knows implies every directory above it.
std::vector<std::string> FakeHost::ListDir(const std::string& path) const {
  const std::string prefix = path + "/";
  std::set<std::string> names;
  const auto add_child = [&](std::string_view known) {
    if (!known.starts_with(prefix) || known.size() == prefix.size()) return;
    known.remove_prefix(prefix.size());
    names.emplace(known.substr(0, known.find('/')));
  };
  for (const auto& file : files) add_child(file.first);
  for (const std::string& device : char_devices) add_child(device);
  for (const std::string& directory : directories) add_child(directory);
  return {names.begin(), names.end()};
}

bool FakeHost::IsCharDevice(const std::string& path) const {
  return std::find(char_devices.begin(), char_devices.end(), path) != char_devices.end();
}

bool FakeHost::IsDirectory(const std::string& path) const {
  return std::find(directories.begin(), directories.end(), path) != directories.end() ||
         !ListDir(path).empty();
}

std::optional<std::string> FakeHost::ReadFile(const std::string& path) const {
  const auto it = files.find(path);
  if (it == files.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> FakeHost::GetEnv(const std::string& name) const {
  const auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

int CountTpuChips(const HostView& host) {
  const int accel_devices = static_cast<int>(DeviceIndices(host, "accel").size());
  if (accel_devices > 0) return accel_devices;
  int tpu_groups = 0;
  for (const std::string& group : host.ListDir("/dev/vfio")) {
    if (ParseIndex(group).has_value() && IsTpuIommuGroup(host, group)) ++tpu_groups;
  }
  return tpu_groups;
}

std::vector<std::string> MapCudaVisibleDevices(
    const std::vector<int>& present, const std::optional<std::string>& cuda_visible_devices) {
  std::vector<std::string> visible;
  if (present.empty()) return visible;
  if (!cuda_visible_devices.has_value()) {
    for (int index : present) visible.push_back(std::to_string(index));
    return visible;
  }
  for (const std::string_view raw : SplitCommas(*cuda_visible_devices)) {
    const std::string_view entry = Trim(raw);
    const bool is_uuid = entry.starts_with("GPU-") || entry.starts_with("MIG-");
    const std::optional<int> index = ParseIndex(entry);
    const bool is_present =
        index.has_value() && std::binary_search(present.begin(), present.end(), *index);
    if (!is_uuid && !is_present) break;
    visible.emplace_back(entry);
  }
  return visible;
}

std::vector<std::string> VisibleGpus(const HostView& host) {
  return MapCudaVisibleDevices(DeviceIndices(host, "nvidia"), host.GetEnv("CUDA_VISIBLE_DEVICES"));
}

TpuHostIdentity ReadTpuHostIdentity(const HostView& host) {
  TpuHostIdentity identity;
  identity.name = host.GetEnv("TPU_NAME").value_or("");
  if (const std::optional<std::string> worker_id = host.GetEnv("TPU_WORKER_ID")) {
    identity.worker_id = ParseIndex(Trim(*worker_id));
  }
  identity.accelerator_type = host.GetEnv("TPU_ACCELERATOR_TYPE").value_or("");
  identity.topology = host.GetEnv("TPU_TOPOLOGY").value_or("");
  return identity;
}

}  // namespace jaxtrain::accelerators
