#include "accelerators/discovery.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace jaxtrain::accelerators {
namespace {

using Strings = std::vector<std::string>;

// A v4/v5p/v6e TPU VM: four chips as /dev/accel0..3.
FakeHost TpuVmWithAccelDevices() {
  FakeHost host;
  host.char_devices = {"/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3", "/dev/null"};
  return host;
}

// Adds /dev/vfio/<group> backed by one PCI device of `vendor`.
void AddVfioGroup(FakeHost& host, const std::string& group, const std::string& vendor) {
  host.char_devices.push_back("/dev/vfio/" + group);
  host.files["/sys/kernel/iommu_groups/" + group + "/devices/0000:00:0" + group + ".0/vendor"] =
      vendor;
}

FakeHost HostWithNvidiaDevices(const std::vector<int>& indices) {
  FakeHost host;
  host.char_devices = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset"};
  for (int index : indices) host.char_devices.push_back("/dev/nvidia" + std::to_string(index));
  return host;
}

TEST(FakeHostTest, KnownPathsImplyTheirDirectories) {
  FakeHost host;
  host.files["/sys/kernel/iommu_groups/7/devices/0000:00:04.0/vendor"] = "0x1ae0\n";
  host.char_devices = {"/dev/accel0"};
  host.directories = {"/dev/vfio"};

  EXPECT_EQ(host.ListDir("/dev"), (Strings{"accel0", "vfio"}));
  EXPECT_EQ(host.ListDir("/sys/kernel/iommu_groups"), (Strings{"7"}));
  EXPECT_EQ(host.ListDir("/dev/vfio"), Strings{});
  EXPECT_EQ(host.ListDir("/proc"), Strings{});
  EXPECT_TRUE(host.IsDirectory("/dev/vfio"));
  EXPECT_TRUE(host.IsDirectory("/sys/kernel/iommu_groups/7/devices"));
  EXPECT_FALSE(host.IsDirectory("/dev/accel0"));
  EXPECT_FALSE(host.IsDirectory("/proc"));
  EXPECT_TRUE(host.IsCharDevice("/dev/accel0"));
  EXPECT_FALSE(host.IsCharDevice("/dev/vfio"));
  EXPECT_EQ(host.ReadFile("/sys/kernel/iommu_groups/7/devices/0000:00:04.0/vendor"), "0x1ae0\n");
  EXPECT_EQ(host.ReadFile("/sys/missing"), std::nullopt);
}

TEST(FakeHostTest, ReportsEnvironmentAndCpus) {
  FakeHost host;
  host.env["TPU_NAME"] = "slice-a";
  host.cpus = 96;
  EXPECT_EQ(host.GetEnv("TPU_NAME"), "slice-a");
  EXPECT_EQ(host.GetEnv("TPU_WORKER_ID"), std::nullopt);
  EXPECT_EQ(host.CpuCount(), 96);
}

TEST(CountTpuChipsTest, CountsAccelCharacterDevices) {
  EXPECT_EQ(CountTpuChips(TpuVmWithAccelDevices()), 4);
}

TEST(CountTpuChipsTest, SkipsAccelDirectoryOfNvidiaDrivers) {
  FakeHost host;
  host.directories = {"/dev/accel"};
  host.char_devices = {"/dev/accel/accel0", "/dev/nvidia0"};
  EXPECT_EQ(CountTpuChips(host), 0);
}

TEST(CountTpuChipsTest, SkipsAccelEntriesThatAreNotNumberedCharacterDevices) {
  FakeHost host;
  host.files["/dev/accel0"] = "";  // a regular file, not a device
  host.directories = {"/dev/accel1"};
  host.char_devices = {"/dev/accelx", "/dev/accel-1", "/dev/accel"};
  EXPECT_EQ(CountTpuChips(host), 0);
}

TEST(CountTpuChipsTest, CountsNoChipsOnAnEmptyHost) { EXPECT_EQ(CountTpuChips(FakeHost()), 0); }

TEST(CountTpuChipsTest, CountsVfioGroupsWhoseDeviceIsGoogles) {
  FakeHost host;
  host.char_devices = {"/dev/vfio/vfio"};  // the VFIO container, not a group
  AddVfioGroup(host, "0", "0x1ae0\n");
  AddVfioGroup(host, "1", "0x1AE0");
  AddVfioGroup(host, "2", " 0x1ae0 \n");
  AddVfioGroup(host, "3", "0x1ae0\n");
  EXPECT_EQ(CountTpuChips(host), 4);
}

TEST(CountTpuChipsTest, SkipsVfioGroupsOfOtherVendors) {
  FakeHost host;
  AddVfioGroup(host, "0", "0x1ae0\n");
  AddVfioGroup(host, "1", "0x10de\n");  // NVIDIA
  AddVfioGroup(host, "9", "0x15b3\n");  // Mellanox BlueField management interface
  EXPECT_EQ(CountTpuChips(host), 1);
}

TEST(CountTpuChipsTest, SkipsVfioGroupsWithoutReadableVendor) {
  FakeHost host;
  host.char_devices = {"/dev/vfio/4", "/dev/vfio/5"};
  host.directories = {"/sys/kernel/iommu_groups/5/devices/0000:00:05.0"};
  EXPECT_EQ(CountTpuChips(host), 0);
}

TEST(CountTpuChipsTest, CountsGroupWhenAnyOfItsDevicesIsGoogles) {
  FakeHost host;
  host.char_devices = {"/dev/vfio/12"};
  host.files["/sys/kernel/iommu_groups/12/devices/0000:00:01.0/vendor"] = "0x8086\n";
  host.files["/sys/kernel/iommu_groups/12/devices/0000:00:02.0/vendor"] = "0x1ae0\n";
  EXPECT_EQ(CountTpuChips(host), 1);
}

TEST(CountTpuChipsTest, PrefersAccelDevicesOverVfioGroups) {
  FakeHost host;
  host.char_devices = {"/dev/accel0", "/dev/accel1"};
  AddVfioGroup(host, "0", "0x1ae0\n");
  AddVfioGroup(host, "1", "0x1ae0\n");
  AddVfioGroup(host, "2", "0x1ae0\n");
  EXPECT_EQ(CountTpuChips(host), 2);
}

TEST(VisibleGpusTest, ListsNvidiaDevicesInIndexOrder) {
  EXPECT_EQ(VisibleGpus(HostWithNvidiaDevices({0, 1, 2, 3})), (Strings{"0", "1", "2", "3"}));
  EXPECT_EQ(VisibleGpus(HostWithNvidiaDevices({10, 2, 1})), (Strings{"1", "2", "10"}));
}

TEST(VisibleGpusTest, FindsNoneWithoutNvidiaDevices) {
  FakeHost host;
  host.char_devices = {"/dev/nvidiactl", "/dev/accel0"};
  host.files["/dev/nvidia0"] = "";  // not a device
  host.env["CUDA_VISIBLE_DEVICES"] = "0";
  EXPECT_EQ(VisibleGpus(host), Strings{});
}

TEST(VisibleGpusTest, FollowsInheritedCudaVisibleDevices) {
  const struct {
    std::string cuda_visible_devices;
    Strings visible;
  } kCases[] = {
      {"3,1", {"3", "1"}},
      {"", {}},
      {"0", {"0"}},
      {" 2 , 0 ", {"2", "0"}},
      {"-1", {}},        // the usual way to hide every GPU
      {"0,7,1", {"0"}},  // CUDA stops at the first index that names no device
      {"1,,2", {"1"}},
      {"0,1,2,3", {"0", "1", "2", "3"}},
      {"GPU-8e4b2f1c-0000-1111-2222-333344445555,1",
       {"GPU-8e4b2f1c-0000-1111-2222-333344445555", "1"}},
      {"MIG-5a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff", {"MIG-5a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff"}},
  };
  for (const auto& c : kCases) {
    FakeHost host = HostWithNvidiaDevices({0, 1, 2, 3});
    host.env["CUDA_VISIBLE_DEVICES"] = c.cuda_visible_devices;
    EXPECT_EQ(VisibleGpus(host), c.visible)
        << "CUDA_VISIBLE_DEVICES='" << c.cuda_visible_devices << "'";
  }
}

TEST(MapCudaVisibleDevicesTest, MapsAHostsDeviceIndicesThroughTheInheritedList) {
  const std::vector<int> present = {0, 1, 2, 3};
  EXPECT_EQ(MapCudaVisibleDevices(present, std::nullopt), (Strings{"0", "1", "2", "3"}));
  EXPECT_EQ(MapCudaVisibleDevices(present, "3,1,2,0"), (Strings{"3", "1", "2", "0"}));
  EXPECT_EQ(MapCudaVisibleDevices(present, "1,9,2"), (Strings{"1"}));
  EXPECT_EQ(MapCudaVisibleDevices({}, "0"), Strings{});
}

TEST(ReadTpuHostIdentityTest, ReadsGkeEnvironment) {
  FakeHost host;
  host.env = {{"TPU_NAME", "my-slice"},
              {"TPU_WORKER_ID", "3"},
              {"TPU_ACCELERATOR_TYPE", "v6e-16"},
              {"TPU_TOPOLOGY", "4x4"}};
  const TpuHostIdentity identity = ReadTpuHostIdentity(host);
  EXPECT_EQ(identity.name, "my-slice");
  EXPECT_EQ(identity.worker_id, 3);
  EXPECT_EQ(identity.accelerator_type, "v6e-16");
  EXPECT_EQ(identity.topology, "4x4");
}

TEST(ReadTpuHostIdentityTest, LeavesFieldsEmptyWhenUnset) {
  const TpuHostIdentity identity = ReadTpuHostIdentity(FakeHost());
  EXPECT_EQ(identity.name, "");
  EXPECT_EQ(identity.worker_id, std::nullopt);
  EXPECT_EQ(identity.accelerator_type, "");
  EXPECT_EQ(identity.topology, "");
}

TEST(ReadTpuHostIdentityTest, IgnoresWorkerIdThatIsNotANumber) {
  const struct {
    std::string worker_id;
    std::optional<int> parsed;
  } kCases[] = {
      {"0", 0},
      {"12", 12},
      {" 7\n", 7},
      {"abc", std::nullopt},
      {"", std::nullopt},
      {"-1", std::nullopt},
      {"3a", std::nullopt},
      {"1.5", std::nullopt},
      {"99999999999", std::nullopt},
  };
  for (const auto& c : kCases) {
    FakeHost host;
    host.env = {{"TPU_NAME", "my-slice"}, {"TPU_WORKER_ID", c.worker_id}};
    const TpuHostIdentity identity = ReadTpuHostIdentity(host);
    EXPECT_EQ(identity.worker_id, c.parsed) << "TPU_WORKER_ID='" << c.worker_id << "'";
    EXPECT_EQ(identity.name, "my-slice");
  }
}

TEST(RealHostTest, ReadsThisMachine) {
  const HostView& host = RealHost();
  EXPECT_GE(host.CpuCount(), 1);
  EXPECT_TRUE(host.IsDirectory("/dev"));
  EXPECT_FALSE(host.IsCharDevice("/dev"));
  EXPECT_TRUE(host.IsCharDevice("/dev/null"));
  EXPECT_FALSE(host.IsDirectory("/dev/null"));
  EXPECT_EQ(host.ListDir("/nonexistent-jaxtrain-dir"), Strings{});
  EXPECT_EQ(host.ReadFile("/nonexistent-jaxtrain-file"), std::nullopt);
  EXPECT_EQ(host.ReadFile("/dev"), std::nullopt);  // a directory is not a readable file
  EXPECT_EQ(host.GetEnv("JAXTRAIN_SURELY_UNSET_VARIABLE"), std::nullopt);
  EXPECT_FALSE(host.HostName().empty());
}

TEST(RealHostTest, ListsAndReadsFiles) {
  std::string dir = ::testing::TempDir() + "jaxtrain_discovery_XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string sub = dir + "/sub";
  const std::string path = dir + "/vendor";
  ASSERT_EQ(mkdir(sub.c_str(), 0700), 0);
  const std::string contents = "0x1ae0\n" + std::string(10000, 'x');  // longer than one read()
  std::FILE* file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs(contents.c_str(), file);
  std::fclose(file);

  const HostView& host = RealHost();
  EXPECT_EQ(host.ListDir(dir), (Strings{"sub", "vendor"}));
  EXPECT_TRUE(host.IsDirectory(sub));
  EXPECT_EQ(host.ReadFile(path), contents);

  unlink(path.c_str());
  rmdir(sub.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace jaxtrain::accelerators
