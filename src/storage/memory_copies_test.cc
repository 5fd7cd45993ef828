#include "storage/memory_copies.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "storage/checkpoint.h"
#include "storage/files.h"

namespace jaxtrain::storage {
namespace {

using nlohmann::json;

class AllPartsHeldInTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/memory_copies_test.XXXXXX";
    dir_ = mkdtemp(tmpl);  // 0700, this user's: the store's parent, as jaxtrain-<uid> is
    store_ = JoinPath(dir_, "store");
    checkpoint_ = JoinPath(dir_, "checkpoint_000002");
    std::filesystem::create_directories(checkpoint_);
    std::filesystem::create_directories(store_);
    chmod(store_.c_str(), 0700);
    // Rank 0 wrote a file, rank 1 a file and a link, rank 2 nothing.
    Write(JoinPath(checkpoint_, kManifestName),
          json{{"file_list", {{{"path", "a"}, {"rank", 0}}, {{"path", "b"}, {"rank", 1}}}},
               {"links", {{{"path", "l"}, {"target", "b"}, {"rank", 1}}}},
               {"copies", {{{"rank", 0}, {"id", "id-0"}}, {{"rank", 1}, {"id", "id-1"}}}}});
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static void Write(const std::string& path, const json& j) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << j.dump();
  }
  void Hold(int rank, const std::string& name, const std::string& id) {
    Write(JoinPath(store_, "rank" + std::to_string(rank) + "/" + name + ".json"),
          json{{"id", id}, {"files", json::array()}});
  }

  std::string dir_, store_, checkpoint_;
};

TEST_F(AllPartsHeldInTest, TrueWhenEveryRankWithFilesHasTheCopyTheManifestNames) {
  Hold(0, "a0-r1", "older");
  Hold(0, "a0-r2", "id-0");
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_)) << "rank 1's part has no copy";
  Hold(1, "a0-r2", "id-1");
  EXPECT_TRUE(AllPartsHeldIn(store_, checkpoint_));
}

TEST_F(AllPartsHeldInTest, FalseForACopyOfAnotherPart) {
  Hold(0, "a0-r2", "id-0");
  Hold(1, "a0-r2", "id-0");  // the right rank and name, another part
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
}

TEST_F(AllPartsHeldInTest, FalseForAStoreOthersMayEnterOrThatIsMissing) {
  Hold(0, "a0-r2", "id-0");
  Hold(1, "a0-r2", "id-1");
  chmod(store_.c_str(), 0755);
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
  EXPECT_FALSE(AllPartsHeldIn(JoinPath(dir_, "missing"), checkpoint_));
}

TEST_F(AllPartsHeldInTest, FalseForAStoreWhoseParentOthersMayEnterOrIsAnotherUsers) {
  Hold(0, "a0-r2", "id-0");
  Hold(1, "a0-r2", "id-1");
  ASSERT_TRUE(AllPartsHeldIn(store_, checkpoint_));
  chmod(dir_.c_str(), 0755);  // the per-user directory, open to others
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
  chmod(dir_.c_str(), 0700);
  if (geteuid() == 0) {  // another user's (tests run as root can make one)
    ASSERT_EQ(chown(dir_.c_str(), 65534, 65534), 0);
    EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
    ASSERT_EQ(chown(dir_.c_str(), 0, 0), 0);
  }
  EXPECT_TRUE(AllPartsHeldIn(store_, checkpoint_));
}

TEST_F(AllPartsHeldInTest, FalseForAManifestWithoutCopiesOrUnreadable) {
  Hold(0, "a0-r2", "id-0");
  Hold(1, "a0-r2", "id-1");
  Write(JoinPath(checkpoint_, kManifestName), json{{"file_list", {{{"path", "a"}, {"rank", 0}}}}});
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
  std::ofstream(JoinPath(checkpoint_, kManifestName)) << "{not json";
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
  Write(JoinPath(checkpoint_, kManifestName),
        json{{"file_list", {{{"path", "a"}}}}, {"copies", 3}});
  EXPECT_FALSE(AllPartsHeldIn(store_, checkpoint_));
}

}  // namespace
}  // namespace jaxtrain::storage
