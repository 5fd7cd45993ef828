#include "placement/hosts.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace jaxtrain::placement {
namespace {

using Strings = std::vector<std::string>;

::testing::AssertionResult HasSubstr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

StatusOr<HostDescription> Parse(const std::string& json, const Environment& inherited = {}) {
  return ParseHostDescription(json, "hosts.json", inherited, "this-box");
}

config::ScalingConfig Make(config::ScalingConfigInput in) {
  auto c = config::ScalingConfig::Create(std::move(in));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(HostDescriptionTest, ParsesEveryField) {
  auto parsed = Parse(R"({"hosts": [
      {"name": "tpu-a-0", "address": "10.0.0.1", "cpus": 96,
       "tpu": {"chips": 4, "slice": "tpu-a", "worker_id": 1, "accelerator_type": "TPU-V4",
               "topology": "2X2x2"}},
      {"name": "gpu-0", "gpus": 2}]})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->source, "hosts.json");
  ASSERT_EQ(parsed->hosts.size(), 2u);
  const Host& tpu = parsed->hosts[0];
  EXPECT_EQ(tpu.name, "tpu-a-0");
  EXPECT_EQ(tpu.address, "10.0.0.1");
  EXPECT_FALSE(tpu.local);
  EXPECT_EQ(tpu.cpus, 96);
  EXPECT_EQ(tpu.gpus, Strings{});
  EXPECT_EQ(tpu.tpu_chips, 4);
  EXPECT_EQ(tpu.tpu_slice, "tpu-a");
  EXPECT_EQ(tpu.tpu_worker_id, 1);
  EXPECT_EQ(tpu.tpu_accelerator_type, "v4-16");  // the pod type, from generation and topology
  EXPECT_EQ(tpu.tpu_topology, "2x2x2");
  const Host& gpu = parsed->hosts[1];
  EXPECT_EQ(gpu.address, "gpu-0");  // defaults to the name
  EXPECT_EQ(gpu.cpus, 0);           // not a limit
  EXPECT_EQ(gpu.gpus, (Strings{"0", "1"}));
  EXPECT_EQ(gpu.tpu_chips, 0);
}

TEST(HostDescriptionTest, ATpuHostWithoutASliceIsASliceOfItsOwn) {
  auto parsed = Parse(R"({"hosts": [{"name": "v6e-box", "tpu": {"chips": 8}}]})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->hosts[0].tpu_slice, "v6e-box");
  EXPECT_EQ(parsed->hosts[0].tpu_worker_id, 0);
  EXPECT_EQ(parsed->hosts[0].tpu_accelerator_type, "");
}

TEST(HostDescriptionTest, MapsEveryHostsGpusThroughTheInheritedCudaVisibleDevices) {
  auto parsed = Parse(R"({"hosts": [{"name": "a", "gpus": 4}, {"name": "b", "gpus": 2}]})",
                      {{"CUDA_VISIBLE_DEVICES", "3,1,2,0"}});
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->hosts[0].gpus, (Strings{"3", "1", "2", "0"}));
  EXPECT_EQ(parsed->hosts[1].gpus, Strings{});  // CUDA stops at "3": b has no such device
}

TEST(HostDescriptionTest, AHostIsThisMachineByNameOrLoopbackAddress) {
  auto parsed = Parse(R"({"hosts": [{"name": "this-box", "address": "10.1.1.1"},
      {"name": "x", "address": "127.0.0.1"}, {"name": "y", "address": "localhost"},
      {"name": "z"}]})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_TRUE(parsed->hosts[0].local);
  EXPECT_TRUE(parsed->hosts[1].local);
  EXPECT_TRUE(parsed->hosts[2].local);
  EXPECT_FALSE(parsed->hosts[3].local);
}

TEST(HostDescriptionTest, RejectsWhatItCannotReadNamingTheHostAndField) {
  const struct {
    std::string json;
    Strings parts;
  } kCases[] = {
      {"{", {"hosts.json is not valid JSON"}},
      {"[]", {"has no list of hosts", "docs/accelerators.md"}},
      {R"({"hosts": []})", {"has no list of hosts"}},
      {R"({"hosts": [{"name": "a"}], "extra": 1})", {"unknown key \"extra\"", "allowed: hosts"}},
      {R"({"hosts": [3]})", {"hosts[0] is 3", "each host is an object"}},
      {R"({"hosts": [{"address": "x"}]})", {"hosts[0] has no \"name\""}},
      {R"({"hosts": [{"name": ""}]})", {"\"name\" is \"\"", "non-empty string"}},
      {R"({"hosts": [{"name": "a", "gpu": 2}]})",
       {"hosts[0] (\"a\")", "unknown key \"gpu\"", "gpus"}},
      {R"({"hosts": [{"name": "a", "gpus": -1}]})", {"\"gpus\" is -1", "whole number >= 0"}},
      {R"({"hosts": [{"name": "a", "cpus": 0}]})", {"\"cpus\" is 0", ">= 1"}},
      {R"({"hosts": [{"name": "a", "gpus": 1.5}]})", {"\"gpus\" is 1.5"}},
      {R"({"hosts": [{"name": "a", "tpu": 4}]})", {"(\"a\").tpu is 4", "{\"chips\": 4}"}},
      {R"({"hosts": [{"name": "a", "tpu": {}}]})", {"tpu has no \"chips\""}},
      {R"({"hosts": [{"name": "a", "tpu": {"chips": 4, "type": "v4"}}]})",
       {"unknown key \"type\"", "accelerator_type"}},
      {R"({"hosts": [{"name": "a", "tpu": {"chips": 4, "accelerator_type": "v9"}}]})",
       {"(\"a\").tpu", "accelerator_type='v9'"}},
      {R"({"hosts": [{"name": "a", "tpu": {"chips": 4, "accelerator_type": "v4",
           "topology": "3x3"}}]})",
       {"(\"a\").tpu", "topology='3x3' is not valid for v4"}},
      {R"({"hosts": [{"name": "a"}, {"name": "a"}]})", {"host name \"a\" appears twice"}},
      {R"({"hosts": [{"name": "-oProxyCommand=sh"}]})",
       {"hosts[0] \"name\": host name \"-oProxyCommand=sh\" is not allowed", "begins with '-'",
        "user@host"}},
      {R"({"hosts": [{"name": "a", "address": "10.0.0.1 -oX=y"}]})",
       {"hosts[0] (\"a\") \"address\": host name \"10.0.0.1 -oX=y\"", "whitespace"}},
      {R"({"hosts": [{"name": "a\tb"}]})", {"\"a\\tb\" is not allowed", "control character"}},
      {R"({"hosts": [{"name": "a", "tpu": {"chips": 4, "slice": "s", "worker_id": 0}},
                     {"name": "b", "tpu": {"chips": 4, "slice": "s"}}]})",
       {"host \"b\" of TPU slice \"s\" has no tpu.worker_id"}},
      {R"({"hosts": [{"name": "a", "tpu": {"chips": 4, "slice": "s", "worker_id": 0}},
                     {"name": "b", "tpu": {"chips": 4, "slice": "s", "worker_id": 0}}]})",
       {"host \"b\" of TPU slice \"s\" has tpu.worker_id 0, as host \"a\" does"}},
      {R"({"hosts": [
           {"name": "a", "tpu": {"chips": 4, "slice": "s", "worker_id": 0, "topology": "2x2x2"}},
           {"name": "b", "tpu": {"chips": 4, "slice": "s", "worker_id": 1, "topology": "2x2x4"}}]})",
       {"host \"b\" of TPU slice \"s\"", "'2x2x4'", "every host of a slice gives the same"}},
  };
  for (const auto& c : kCases) {
    auto parsed = Parse(c.json);
    ASSERT_FALSE(parsed.ok()) << c.json;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.json;
    for (const std::string& part : c.parts) EXPECT_TRUE(HasSubstr(parsed.status().message(), part));
  }
}

TEST(HostDescriptionTest, LoadsTheFileThroughTheHostView) {
  accelerators::FakeHost view;
  view.hostname = "a";
  view.files["/etc/hosts.json"] = R"({"hosts": [{"name": "a"}]})";
  auto loaded = LoadHostDescription(view, "/etc/hosts.json", {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->source, "JAXTRAIN_HOSTS=/etc/hosts.json");
  EXPECT_TRUE(loaded->hosts[0].local);

  auto missing = LoadHostDescription(view, "/nope.json", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasSubstr(missing.status().message(), "JAXTRAIN_HOSTS=/nope.json cannot be read"));
}

TEST(DescribeThisHostTest, ReadsChipsIdentityAndGpusOfThisMachine) {
  accelerators::FakeHost view;
  view.hostname = "tpu-vm-1";
  view.char_devices = {"/dev/accel0", "/dev/accel1",  "/dev/accel2",
                       "/dev/accel3", "/dev/nvidia0", "/dev/nvidia1"};
  view.env = {{"TPU_NAME", "my-slice"},
              {"TPU_WORKER_ID", "1"},
              {"TPU_ACCELERATOR_TYPE", "v4-16"},
              {"TPU_TOPOLOGY", "2x2x2"},
              {"CUDA_VISIBLE_DEVICES", "1"}};
  const HostDescription described = DescribeThisHost(view);
  EXPECT_EQ(described.source, "this machine");
  ASSERT_EQ(described.hosts.size(), 1u);
  const Host& host = described.hosts[0];
  EXPECT_EQ(host.name, "tpu-vm-1");
  EXPECT_EQ(host.address, "localhost");
  EXPECT_TRUE(host.local);
  EXPECT_EQ(host.cpus, 0);
  EXPECT_EQ(host.gpus, Strings{"1"});
  EXPECT_EQ(host.tpu_chips, 4);
  EXPECT_EQ(host.tpu_slice, "my-slice");
  EXPECT_EQ(host.tpu_worker_id, 1);
  EXPECT_EQ(host.tpu_accelerator_type, "v4-16");
  EXPECT_EQ(host.tpu_topology, "2x2x2");
}

TEST(SimulatedHostsTest, TpuSlicesAreWholeAndNamedBySliceAndWorker) {
  config::ScalingConfigInput in;
  in.num_workers = 4;
  in.use_tpu = true;
  in.topology = "2x2x2";
  in.accelerator_type = "TPU-V4";
  const HostDescription hosts = SimulatedHosts(Make(in));
  ASSERT_EQ(hosts.hosts.size(), 4u);
  Strings names;
  for (const Host& h : hosts.hosts) {
    names.push_back(h.name);
    EXPECT_EQ(h.tpu_chips, 4);
    EXPECT_EQ(h.tpu_accelerator_type, "v4-16");
    EXPECT_EQ(h.tpu_topology, "2x2x2");
  }
  EXPECT_EQ(names, (Strings{"sim-slice-0-host-0", "sim-slice-0-host-1", "sim-slice-1-host-0",
                            "sim-slice-1-host-1"}));
  EXPECT_EQ(hosts.hosts[3].tpu_slice, "sim-slice-1");
  EXPECT_EQ(hosts.hosts[3].tpu_worker_id, 1);
}

TEST(SimulatedHostsTest, GpuHostsFollowTheStrategy) {
  config::ScalingConfigInput in;
  in.num_workers = 3;
  in.use_gpu = true;
  in.resources_per_worker = {{"GPU", 2}};
  const HostDescription packed = SimulatedHosts(Make(in));
  ASSERT_EQ(packed.hosts.size(), 1u);
  EXPECT_EQ(packed.hosts[0].gpus.size(), 6u);
  in.placement_strategy = "STRICT_SPREAD";
  const HostDescription spread = SimulatedHosts(Make(in));
  ASSERT_EQ(spread.hosts.size(), 3u);
  EXPECT_EQ(spread.hosts[2].gpus, (Strings{"0", "1"}));
}

}  // namespace
}  // namespace jaxtrain::placement
