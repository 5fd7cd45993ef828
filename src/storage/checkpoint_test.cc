#include "storage/checkpoint.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "storage/crc32c.h"
#include "storage/files.h"
#include "storage/metrics.h"
#include "storage/testing/fault_injecting_filesystem.h"

namespace jaxtrain::storage {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

::testing::AssertionResult HasText(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

void WriteTestFile(const std::string& path, std::string_view contents) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string ReadTestFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// Every regular file under `dir`, relative to it, sorted.
std::vector<std::string> ListFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out.push_back(fs::relative(e.path(), dir).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Everything directly in `dir` (nothing when it does not exist).
std::vector<std::string> ListEntries(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

uint32_t CrcOf(std::string_view s) { return Crc32c(0, s.data(), s.size()); }

// Bytes that are not all alike, so that copies and checksums are really compared.
std::string Pattern(size_t n, unsigned seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : s) {
    x = x * 1103515245u + 12345u;
    c = static_cast<char>(x >> 24);
  }
  return s;
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<std::string> Names(const std::vector<CheckpointRecord>& records) {
  std::vector<std::string> out;
  for (const auto& r : records) out.push_back(r.dir_name);
  return out;
}

// A fresh directory under /tmp per test, removed with its contents afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/jaxtrain_checkpoint_XXXXXX";
    const char* dir = mkdtemp(tmpl);
    ASSERT_NE(dir, nullptr) << "mkdtemp failed";
    root_ = dir;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::string Path(std::string_view rel) const { return JoinPath(root_, rel); }

  std::string root_;
};

// --- Crc32c --------------------------------------------------------------------------------------

// An independent bit-at-a-time CRC-32C to check the library against.
uint32_t BitwiseCrc32c(uint32_t crc, const unsigned char* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

TEST(Crc32cTest, MatchesKnownVectors) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(CrcOf(zeros), 0x8A9136AAu);
  // The other iSCSI vectors of RFC 3720 B.4.
  const std::string ones(32, '\xff');
  EXPECT_EQ(CrcOf(ones), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(CrcOf(ascending), 0x46DD794Eu);
  std::string descending(ascending.rbegin(), ascending.rend());
  EXPECT_EQ(CrcOf(descending), 0x113FDB5Cu);
}

TEST(Crc32cTest, EmptyInputLeavesTheCrcUnchanged) {
  EXPECT_EQ(Crc32c(0, nullptr, 0), 0u);
  EXPECT_EQ(Crc32c(0xE3069283u, "", 0), 0xE3069283u);
}

TEST(Crc32cTest, IncrementalEqualsOneShot) {
  const std::string data = Pattern(1000, 1);
  const uint32_t whole = CrcOf(data);
  for (size_t split = 0; split <= data.size(); ++split) {
    uint32_t crc = Crc32c(0, data.data(), split);
    crc = Crc32c(crc, data.data() + split, data.size() - split);
    ASSERT_EQ(crc, whole) << "split at " << split;
  }
  // Many small uneven pieces.
  uint32_t crc = 0;
  for (size_t pos = 0, step = 1; pos < data.size(); pos += step, step = step % 13 + 1) {
    crc = Crc32c(crc, data.data() + pos, std::min(step, data.size() - pos));
  }
  EXPECT_EQ(crc, whole);
}

// Crc32c takes the SSE4.2 path on CPUs that have it (it is not selectable through the API); a
// software CRC written independently must agree with it for every length around the 8-byte word
// size and for every misalignment of the start.
TEST(Crc32cTest, MatchesABitwiseSoftwareCrcForEveryLengthAndAlignment) {
  const std::string buffer = Pattern(128, 7);
  const auto* bytes = reinterpret_cast<const unsigned char*>(buffer.data());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n <= 100; ++n) {
      ASSERT_EQ(Crc32c(0, bytes + offset, n), BitwiseCrc32c(0, bytes + offset, n))
          << "offset " << offset << ", length " << n;
      ASSERT_EQ(Crc32c(0x12345678u, bytes + offset, n),
                BitwiseCrc32c(0x12345678u, bytes + offset, n))
          << "continuing a crc, offset " << offset << ", length " << n;
    }
  }
}

// --- ParseMetricsJson / MetricValue --------------------------------------------------------------

TEST(ParseMetricsJsonTest, NonFiniteTokensBecomeStrings) {
  json m =
      ParseMetricsJson(R"({"a": NaN, "b": Infinity, "c": -Infinity, "d": [NaN, 1, -Infinity]})");
  ASSERT_FALSE(m.is_discarded());
  EXPECT_EQ(m["a"], "NaN");
  EXPECT_EQ(m["b"], "Infinity");
  EXPECT_EQ(m["c"], "-Infinity");
  EXPECT_EQ(m["d"], json::parse(R"(["NaN", 1, "-Infinity"])"));
}

TEST(ParseMetricsJsonTest, FiniteValuesAreKept) {
  json m = ParseMetricsJson(R"({"loss": 0.25, "step": -3, "tiny": 1e-3, "ok": true, "n": null})");
  ASSERT_FALSE(m.is_discarded());
  EXPECT_EQ(m["loss"], 0.25);
  EXPECT_EQ(m["step"], -3);
  EXPECT_EQ(m["tiny"], 1e-3);
  EXPECT_EQ(m["ok"], true);
  EXPECT_TRUE(m["n"].is_null());
}

TEST(ParseMetricsJsonTest, TokensInsideStringsAreUntouched) {
  json m = ParseMetricsJson(
      R"({"s": "NaN Infinity -Infinity", "q": "say \"NaN\" Infinity", "k\"NaN": 1,)"
      R"( "b": "ends with a backslash \\", "after": NaN})");
  ASSERT_FALSE(m.is_discarded());
  EXPECT_EQ(m["s"], "NaN Infinity -Infinity");
  EXPECT_EQ(m["q"], "say \"NaN\" Infinity");
  EXPECT_EQ(m["k\"NaN"], 1);
  EXPECT_EQ(m["b"], "ends with a backslash \\");
  // The escaped backslash must not leave the parser inside the string.
  EXPECT_EQ(m["after"], "NaN");
}

TEST(ParseMetricsJsonTest, InvalidJsonIsDiscarded) {
  for (std::string_view text :
       {"", "{", "not json", R"({"a": nan})", R"({"a": 1,})", R"({"a": "unterminated})"}) {
    EXPECT_TRUE(ParseMetricsJson(text).is_discarded()) << text;
  }
}

TEST(MetricValueTest, ReadsATopLevelNumber) {
  json m = {{"loss", 0.5}, {"step", 7}};
  EXPECT_EQ(MetricValue(m, "loss"), 0.5);
  EXPECT_EQ(MetricValue(m, "step"), 7.0);
}

TEST(MetricValueTest, ReadsNestedKeysJoinedWithSlash) {
  json m = json::parse(R"({"eval": {"acc": 0.75, "deep": {"x": -2}}})");
  EXPECT_EQ(MetricValue(m, "eval/acc"), 0.75);
  EXPECT_EQ(MetricValue(m, "eval/deep/x"), -2.0);
}

TEST(MetricValueTest, ReadsAKeyThatItselfContainsASlash) {
  json m = json::parse(R"({"val/loss": 0.5, "eval": {"acc/top1": 0.7}})");
  EXPECT_EQ(MetricValue(m, "val/loss"), 0.5);
  EXPECT_EQ(MetricValue(m, "eval/acc/top1"), 0.7);
}

// A metric "acc/top5" beside a metric "acc" (a common naming) is still found.
TEST(MetricValueTest, ReadsAKeyWithASlashWhenItsFirstPartIsAlsoAMetric) {
  json m = json::parse(R"({"acc": 0.9, "acc/top5": 0.99})");
  EXPECT_EQ(MetricValue(m, "acc"), 0.9);
  EXPECT_EQ(MetricValue(m, "acc/top5"), 0.99);
}

TEST(MetricValueTest, ReadsNonFiniteValuesStoredAsStrings) {
  json m = ParseMetricsJson(R"({"a": NaN, "b": Infinity, "c": -Infinity})");
  auto a = MetricValue(m, "a");
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(std::isnan(*a));
  EXPECT_EQ(MetricValue(m, "b"), std::numeric_limits<double>::infinity());
  EXPECT_EQ(MetricValue(m, "c"), -std::numeric_limits<double>::infinity());
}

TEST(MetricValueTest, MissingKeyIsNullopt) {
  json m = json::parse(R"({"a": {"b": 1}, "n": 2})");
  EXPECT_EQ(MetricValue(m, "nope"), std::nullopt);
  EXPECT_EQ(MetricValue(m, "a/nope"), std::nullopt);
  EXPECT_EQ(MetricValue(m, "a/b/c"), std::nullopt);
  EXPECT_EQ(MetricValue(m, "n/x"), std::nullopt);
  EXPECT_EQ(MetricValue(json::object(), "a"), std::nullopt);
  EXPECT_EQ(MetricValue(json::array({1, 2}), "0"), std::nullopt);
}

TEST(MetricValueTest, NonNumericValueIsNullopt) {
  json m = json::parse(R"({"s": "hello", "b": true, "z": null, "o": {"x": 1}, "l": [1]})");
  for (const char* key : {"s", "b", "z", "o", "l"}) {
    EXPECT_EQ(MetricValue(m, key), std::nullopt) << key;
  }
}

// --- StageDirectory ------------------------------------------------------------------------------

class StageDirectoryTest : public TempDirTest {};

TEST_F(StageDirectoryTest, CopiesNestedFilesByteExactWithSizesAndChecksums) {
  const std::map<std::string, std::string> files = {
      {"model.bin", Pattern(5000, 1)},
      {"empty.txt", ""},
      {"opt/state.txt", "step=12\n"},
      {"opt/deep/er/x.bin", Pattern(77, 2)},
  };
  const std::string src = Path("src");
  for (const auto& [rel, contents] : files) WriteTestFile(JoinPath(src, rel), contents);
  fs::create_directories(JoinPath(src, "empty_dir"));

  const std::string dst = Path("staged/rank0");
  auto entries = StageDirectory(src, dst);
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();

  std::map<std::string, FileEntry> by_path;
  for (const auto& e : *entries) by_path[e.path] = e;
  ASSERT_EQ(by_path.size(), files.size());
  for (const auto& [rel, contents] : files) {
    SCOPED_TRACE(rel);
    ASSERT_EQ(by_path.count(rel), 1u);
    EXPECT_EQ(by_path[rel].size, contents.size());
    EXPECT_EQ(by_path[rel].crc32c, CrcOf(contents));
    EXPECT_TRUE(ReadTestFile(JoinPath(dst, rel)) == contents);
  }
  std::vector<std::string> expected;
  for (const auto& [rel, contents] : files) expected.push_back(rel);
  EXPECT_EQ(ListFiles(dst), Sorted(expected));
  // The source is left as it was.
  EXPECT_TRUE(ReadTestFile(JoinPath(src, "model.bin")) == files.at("model.bin"));
}

// Larger than the 4 MiB copy chunk, so the copy and its checksum span several reads. (About 3 s,
// most of it the fsync.)
TEST_F(StageDirectoryTest, CopiesAFileLargerThanOneReadChunk) {
  const std::string contents = Pattern((4 << 20) + 123, 3);
  WriteTestFile(Path("src/big.bin"), contents);
  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  ASSERT_EQ(entries->size(), 1u);
  EXPECT_EQ((*entries)[0].size, contents.size());
  EXPECT_EQ((*entries)[0].crc32c, CrcOf(contents));
  EXPECT_TRUE(ReadTestFile(Path("dst/big.bin")) == contents);
}

TEST_F(StageDirectoryTest, EmptyDirectoryStagesNoFiles) {
  fs::create_directories(Path("src"));
  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_TRUE(entries->empty());
  EXPECT_TRUE(fs::is_directory(Path("dst")));
}

TEST_F(StageDirectoryTest, MissingSourceIsNotFoundNamingThePath) {
  const std::string src = Path("no_such_dir");
  auto entries = StageDirectory(src, Path("dst"));
  EXPECT_EQ(entries.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasText(entries.status().message(), src));
}

TEST_F(StageDirectoryTest, FileAsSourceIsInvalidArgumentNamingThePath) {
  const std::string src = Path("model.bin");
  WriteTestFile(src, "weights");
  auto entries = StageDirectory(src, Path("dst"));
  EXPECT_EQ(entries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(entries.status().message(), src));
  EXPECT_TRUE(HasText(entries.status().message(), "not a directory"));
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 ? st.st_mode & 07777 : 0;
}

// Sets the umask for one test and restores it afterwards.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(umask(mask)) {}
  ~ScopedUmask() { umask(old_); }

 private:
  mode_t old_;
};

TEST_F(StageDirectoryTest, KeepsFileAndDirectoryModesWithinTheUmask) {
  ScopedUmask mask(022);
  WriteTestFile(Path("src/secret.key"), "token");
  WriteTestFile(Path("src/run.sh"), "#!/bin/sh\n");
  WriteTestFile(Path("src/wide.txt"), "everyone may write");
  WriteTestFile(Path("src/private/inner.bin"), "x");
  fs::permissions(Path("src/secret.key"), fs::perms(0600));
  fs::permissions(Path("src/run.sh"), fs::perms(0750));
  fs::permissions(Path("src/wide.txt"), fs::perms(0666));
  fs::permissions(Path("src/private"), fs::perms(0700));

  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(ModeOf(Path("dst/secret.key")), 0600u);
  EXPECT_EQ(ModeOf(Path("dst/run.sh")), 0750u);
  EXPECT_EQ(ModeOf(Path("dst/wide.txt")), 0644u);  // never wider than the umask allows
  EXPECT_EQ(ModeOf(Path("dst/private")), 0700u);
  std::map<std::string, uint32_t> modes;
  for (const auto& e : *entries) modes[e.path] = e.mode;
  EXPECT_EQ(modes["secret.key"], 0600u);
  EXPECT_EQ(modes["wide.txt"], 0644u);
}

TEST_F(StageDirectoryTest, APrivateUmaskMakesEveryStagedFileAndDirectoryPrivate) {
  ScopedUmask mask(077);
  WriteTestFile(Path("src/sub/model.bin"), "weights");
  fs::permissions(Path("src/sub/model.bin"), fs::perms(0644));
  fs::permissions(Path("src/sub"), fs::perms(0755));
  ASSERT_TRUE(StageDirectory(Path("src"), Path("dst")).ok());
  EXPECT_EQ(ModeOf(Path("dst/sub/model.bin")), 0600u);
  EXPECT_EQ(ModeOf(Path("dst/sub")), 0700u);
}

TEST_F(StageDirectoryTest, KeepsALinkToAFileInsideAsALinkAndCopiesTheFileOnce) {
  WriteTestFile(Path("src/weights/v1.bin"), "real contents");
  fs::create_symlink("weights/v1.bin", Path("src/latest.bin"));
  fs::create_directory_symlink("weights", Path("src/alias"));

  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  std::map<std::string, FileEntry> by_path;
  for (const auto& e : *entries) by_path[e.path] = e;
  ASSERT_EQ(by_path.size(), 3u);
  EXPECT_EQ(by_path["latest.bin"].link, "weights/v1.bin");
  EXPECT_EQ(by_path["alias"].link, "weights");
  EXPECT_EQ(by_path["weights/v1.bin"].link, "");
  EXPECT_TRUE(fs::is_symlink(Path("dst/latest.bin")));
  EXPECT_TRUE(fs::is_symlink(Path("dst/alias")));
  EXPECT_EQ(ReadTestFile(Path("dst/latest.bin")), "real contents");
  int copies = 0;  // files, not links: the target's bytes were copied once
  for (const auto& e : fs::recursive_directory_iterator(Path("dst"))) {
    copies += e.is_regular_file() && !e.is_symlink();
  }
  EXPECT_EQ(copies, 1);
}

TEST_F(StageDirectoryTest, AnAbsoluteLinkToAFileInsideIsKeptRelative) {
  WriteTestFile(Path("src/a/model.bin"), "m");
  fs::create_directories(Path("src/b/c"));
  fs::create_symlink(Path("src/a/model.bin"), Path("src/b/c/link.bin"));
  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(fs::read_symlink(Path("dst/b/c/link.bin")).string(), "../../a/model.bin");
  EXPECT_EQ(ReadTestFile(Path("dst/b/c/link.bin")), "m");
}

TEST_F(StageDirectoryTest, ALinkToAFileOutsideIsRefusedNamingTheLinkAndItsTarget) {
  WriteTestFile(Path("elsewhere/weights.bin"), "private");
  WriteTestFile(Path("src/ok.bin"), "ok");
  fs::create_symlink(Path("elsewhere/weights.bin"), Path("src/link.bin"));

  auto entries = StageDirectory(Path("src"), Path("dst"));
  EXPECT_EQ(entries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(entries.status().message(), "'link.bin'"));
  EXPECT_TRUE(HasText(entries.status().message(), Path("elsewhere/weights.bin")));
  EXPECT_TRUE(HasText(entries.status().message(), "outside"));
  EXPECT_FALSE(Exists(Path("dst/link.bin")));
}

TEST_F(StageDirectoryTest, ALinkToADirectoryOutsideIsRefusedAndNotWalked) {
  WriteTestFile(Path("outside/big.bin"), Pattern(1000, 4));
  fs::create_directories(Path("src"));
  fs::create_directory_symlink(Path("outside"), Path("src/dirlink"));
  fs::create_directory_symlink("/etc", Path("src/etc"));

  auto entries = StageDirectory(Path("src"), Path("dst"));
  EXPECT_EQ(entries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(entries.status().message(), "dirlink"));
  EXPECT_FALSE(fs::exists(Path("dst")));  // the tree is listed before anything is written
}

TEST_F(StageDirectoryTest, ARelativeLinkThatClimbsOutIsRefused) {
  WriteTestFile(Path("secret.txt"), "s");
  fs::create_directories(Path("src/sub"));
  fs::create_symlink("../../secret.txt", Path("src/sub/up.txt"));
  auto entries = StageDirectory(Path("src"), Path("dst"));
  EXPECT_EQ(entries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(entries.status().message(), "'sub/up.txt' -> '../../secret.txt'"));
}

TEST_F(StageDirectoryTest, ADanglingLinkIsKeptOnlyWhenItsNameStaysInside) {
  fs::create_directories(Path("src"));
  fs::create_symlink("not_yet.bin", Path("src/inside.bin"));
  auto entries = StageDirectory(Path("src"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(fs::read_symlink(Path("dst/inside.bin")).string(), "not_yet.bin");

  fs::create_symlink("/nonexistent/x", Path("src/outside.bin"));
  entries = StageDirectory(Path("src"), Path("dst2"));
  EXPECT_EQ(entries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(entries.status().message(), "'outside.bin' -> '/nonexistent/x'"));
}

TEST_F(StageDirectoryTest, TheSourceItselfMayBeALinkToADirectory) {
  WriteTestFile(Path("real/model.bin"), "m");
  fs::create_directory_symlink(Path("real"), Path("named"));
  auto entries = StageDirectory(Path("named"), Path("dst"));
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(ReadTestFile(Path("dst/model.bin")), "m");
}

// SHA-256 test vectors (FIPS 180-2): "abc", and the empty string.
constexpr char kSha256Abc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr char kSha256Empty[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

TEST_F(StageDirectoryTest, WithHashEachFileGetsItsSha256InTheSamePass) {
  WriteTestFile(Path("src/abc.txt"), "abc");
  WriteTestFile(Path("src/empty.txt"), "");
  // Larger than a copy chunk and a checksum piece, so the sum spans several.
  const std::string big = Pattern((5 << 20) + 3, 9);
  WriteTestFile(Path("src/big.bin"), big);
  auto hashed = StageDirectory(Path("src"), Path("hashed"), /*durable=*/false, /*hash=*/true);
  ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
  std::map<std::string, FileEntry> by_path;
  for (const auto& e : *hashed) by_path[e.path] = e;
  EXPECT_EQ(by_path["abc.txt"].sha256, kSha256Abc);
  EXPECT_EQ(by_path["empty.txt"].sha256, kSha256Empty);
  EXPECT_EQ(by_path["abc.txt"].crc32c, CrcOf("abc"));
  EXPECT_EQ(by_path["big.bin"].crc32c, CrcOf(big));
  EXPECT_TRUE(IsSha256HexOrEmpty(by_path["big.bin"].sha256));
  EXPECT_EQ(by_path["big.bin"].sha256.size(), kSha256HexSize);
  // Without it, no hash is computed.
  auto plain = StageDirectory(Path("src"), Path("plain"), /*durable=*/false);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  for (const auto& e : *plain) EXPECT_EQ(e.sha256, "") << e.path;
}

// --- SnapshotDirectory / WriteSnapshot -----------------------------------------------------------

class SnapshotDirectoryTest : public TempDirTest {};

bool SameEntry(const FileEntry& a, const FileEntry& b) {
  return a.path == b.path && a.size == b.size && a.crc32c == b.crc32c && a.mode == b.mode &&
         a.link == b.link;
}

TEST_F(SnapshotDirectoryTest, WritesTheSameFilesModesLinksAndChecksumsAsStageDirectory) {
  ScopedUmask mask(022);
  // More than two of the 16 MiB chunks WriteSnapshot writes and starts the writeback of at once.
  WriteTestFile(Path("src/model.bin"), Pattern((33 << 20) + 7, 4));
  WriteTestFile(Path("src/empty.txt"), "");
  WriteTestFile(Path("src/opt/deep/state.txt"), "step=3\n");
  fs::permissions(Path("src/model.bin"), fs::perms(0600));
  fs::permissions(Path("src/opt"), fs::perms(0750));
  fs::create_symlink("opt/deep/state.txt", Path("src/latest.txt"));
  fs::create_directories(Path("src/empty_dir"));

  auto staged = StageDirectory(Path("src"), Path("staged"), /*durable=*/false);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  auto snapshot = SnapshotDirectory(Path("src"), 64 << 20);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  EXPECT_EQ(snapshot->bytes, (33u << 20) + 7 + 7);
  auto written = WriteSnapshot(*snapshot, Path("written"));
  ASSERT_TRUE(written.ok()) << written.status().ToString();

  ASSERT_EQ(written->size(), staged->size());
  for (size_t i = 0; i < staged->size(); ++i) {
    SCOPED_TRACE((*staged)[i].path);
    EXPECT_TRUE(SameEntry((*written)[i], (*staged)[i]));
  }
  EXPECT_EQ(ListFiles(Path("written")), ListFiles(Path("staged")));
  EXPECT_TRUE(ReadTestFile(Path("written/model.bin")) == ReadTestFile(Path("src/model.bin")));
  EXPECT_EQ(ModeOf(Path("written/model.bin")), 0600u);
  EXPECT_EQ(ModeOf(Path("written/opt")), 0750u);
  EXPECT_TRUE(fs::is_symlink(Path("written/latest.txt")));
  EXPECT_TRUE(fs::is_directory(Path("written/empty_dir")));
}

TEST_F(SnapshotDirectoryTest, WithHashWritesTheSha256sStageDirectoryComputesAndHashesOnce) {
  WriteTestFile(Path("src/abc.txt"), "abc");
  WriteTestFile(Path("src/big.bin"), Pattern((3 << 20) + 1, 5));
  auto staged = StageDirectory(Path("src"), Path("staged"), /*durable=*/false, /*hash=*/true);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  auto snapshot = SnapshotDirectory(Path("src"), 64 << 20);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  auto plain = WriteSnapshot(*snapshot, Path("plain"));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  for (const auto& e : *plain) EXPECT_EQ(e.sha256, "") << e.path;
  auto first = WriteSnapshot(*snapshot, Path("first"), /*hash=*/true);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->size(), staged->size());
  for (size_t i = 0; i < staged->size(); ++i) {
    SCOPED_TRACE((*staged)[i].path);
    EXPECT_EQ((*first)[i].sha256, (*staged)[i].sha256);
  }
  // The second write (the copy kept in host memory) takes the hashes the first computed.
  for (const auto& item : snapshot->items) {
    if (item.kind == DirectorySnapshot::Kind::kFile) {
      EXPECT_FALSE(item.sha256.empty());
    }
  }
  auto second = WriteSnapshot(*snapshot, Path("second"), /*hash=*/true);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  for (size_t i = 0; i < first->size(); ++i) EXPECT_EQ((*second)[i].sha256, (*first)[i].sha256);
}

TEST_F(SnapshotDirectoryTest, DescribeGivesWhatWritingItWouldWithoutWriting) {
  WriteTestFile(Path("src/abc.txt"), "abc");
  WriteTestFile(Path("src/sub/big.bin"), Pattern((3 << 20) + 1, 7));
  fs::create_symlink("abc.txt", Path("src/link"));
  auto snapshot = SnapshotDirectory(Path("src"), 64 << 20);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  const std::vector<FileEntry> described = DescribeSnapshot(*snapshot, /*hash=*/true);
  EXPECT_FALSE(fs::exists(Path("written")));
  auto written = WriteSnapshot(*snapshot, Path("written"), /*hash=*/true);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_EQ(described.size(), written->size());
  for (size_t i = 0; i < described.size(); ++i) {
    SCOPED_TRACE((*written)[i].path);
    EXPECT_EQ(described[i].path, (*written)[i].path);
    EXPECT_EQ(described[i].size, (*written)[i].size);
    EXPECT_EQ(described[i].crc32c, (*written)[i].crc32c);
    EXPECT_EQ(described[i].mode, (*written)[i].mode);
    EXPECT_EQ(described[i].link, (*written)[i].link);
    EXPECT_EQ(described[i].sha256, (*written)[i].sha256);
  }
  auto abc = std::find_if(described.begin(), described.end(),
                          [](const FileEntry& e) { return e.path == "abc.txt"; });
  ASSERT_NE(abc, described.end());
  EXPECT_EQ(abc->sha256, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_F(SnapshotDirectoryTest, IsIndependentOfTheSourceOnceTaken) {
  const std::string contents = Pattern(100000, 5);
  WriteTestFile(Path("src/shard.bin"), contents);
  auto snapshot = SnapshotDirectory(Path("src"), 1 << 20);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  WriteTestFile(Path("src/shard.bin"), "changed");
  fs::remove_all(Path("src"));
  auto written = WriteSnapshot(*snapshot, Path("dst"));
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_EQ(written->size(), 1u);
  EXPECT_EQ((*written)[0].crc32c, CrcOf(contents));
  EXPECT_TRUE(ReadTestFile(Path("dst/shard.bin")) == contents);
}

TEST_F(SnapshotDirectoryTest, TheNextSnapshotReadsIntoTheLastOnesMemoryAndHoldsItsOwnBytes) {
  WriteTestFile(Path("round1/shard.bin"), Pattern(300000, 6));
  WriteTestFile(Path("round2/shard.bin"), Pattern(300000, 7));
  const char* first = nullptr;
  {
    auto snapshot = SnapshotDirectory(Path("round1"), 1 << 20);
    ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
    first = snapshot->items[0].data.get();
  }
  EXPECT_GE(KeptSnapshotBytes(), 300000u);  // kept for the next snapshot, not unmapped

  auto second = SnapshotDirectory(Path("round2"), 1 << 20);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->items[0].data.get(), first);
  EXPECT_EQ(KeptSnapshotBytes(), 0u);
  auto written = WriteSnapshot(*second, Path("dst"));
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_TRUE(ReadTestFile(Path("dst/shard.bin")) == Pattern(300000, 7));
  EXPECT_EQ((*written)[0].crc32c, CrcOf(Pattern(300000, 7)));
}

TEST_F(SnapshotDirectoryTest, KeptMemoryThatTheNextSnapshotCannotUseIsUnmapped) {
  WriteTestFile(Path("small/a.bin"), Pattern(5000, 1));
  WriteTestFile(Path("small/b.bin"), Pattern(6000, 2));
  WriteTestFile(Path("large/a.bin"), Pattern(200000, 3));
  { ASSERT_TRUE(SnapshotDirectory(Path("small"), 1 << 20).ok()); }
  EXPECT_GE(KeptSnapshotBytes(), 11000u);

  auto large = SnapshotDirectory(Path("large"), 1 << 20);  // too large for either kept buffer
  ASSERT_TRUE(large.ok()) << large.status().ToString();
  EXPECT_EQ(KeptSnapshotBytes(), 0u);
}

TEST_F(SnapshotDirectoryTest, AboveTheBudgetIsResourceExhaustedNamingTheSizes) {
  WriteTestFile(Path("src/a.bin"), Pattern(600, 6));
  WriteTestFile(Path("src/b.bin"), Pattern(600, 7));
  auto snapshot = SnapshotDirectory(Path("src"), 1000);
  ASSERT_EQ(snapshot.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(HasText(snapshot.status().message(), "1200 bytes"));
  EXPECT_TRUE(HasText(snapshot.status().message(), "budget of 1000 bytes"));
  EXPECT_TRUE(SnapshotDirectory(Path("src"), 1200).ok());
}

TEST_F(SnapshotDirectoryTest, RefusesALinkOutsideAndAMissingSourceAsStageDirectoryDoes) {
  WriteTestFile(Path("outside.txt"), "x");
  fs::create_directories(Path("src"));
  fs::create_symlink(Path("outside.txt"), Path("src/leak"));
  EXPECT_EQ(SnapshotDirectory(Path("src"), 1 << 20).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SnapshotDirectory(Path("missing"), 1 << 20).status().code(), StatusCode::kNotFound);
}

TEST_F(SnapshotDirectoryTest, AWriteIntoADirectoryThatCannotBeCreatedNamesThePath) {
  WriteTestFile(Path("src/a.bin"), "a");
  WriteTestFile(Path("blocker"), "a file where the directory should go");
  auto snapshot = SnapshotDirectory(Path("src"), 1 << 20);
  ASSERT_TRUE(snapshot.ok());
  auto written = WriteSnapshot(*snapshot, Path("blocker/dst"));
  ASSERT_FALSE(written.ok());
  EXPECT_TRUE(HasText(written.status().message(), Path("blocker")));
}

TEST(CleanRelativePathTest, RefusesAbsoluteDotDotDotAndEmptyParts) {
  for (const char* ok : {"a", "a/b.bin", "a.b/.hidden", "..a/b.."}) {
    EXPECT_TRUE(IsCleanRelativePath(ok)) << ok;
  }
  for (const char* bad :
       {"", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", ".", ".."}) {
    EXPECT_FALSE(IsCleanRelativePath(bad)) << bad;
  }
}

// --- CommitCheckpoint / ReadCheckpointRecord -----------------------------------------------------

TEST(StagingPathTest, IsOneDirectoryPerAttemptRoundAndRankUnderStaging) {
  EXPECT_EQ(StagingPath("/runs/r", 2, 7, 3), "/runs/r/.staging/a2-r7-rank3");
  EXPECT_NE(StagingPath("/runs/r", 1, 7, 3), StagingPath("/runs/r", 2, 7, 3));
  EXPECT_NE(StagingPath("/runs/r", 1, 7, 3), StagingPath("/runs/r", 1, 8, 3));
  EXPECT_NE(StagingPath("/runs/r", 1, 7, 3), StagingPath("/runs/r", 1, 7, 4));
}

class CommitTest : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    run_ = Path("run");
    fs::create_directories(run_);
  }

  // Writes `files` (relative path -> contents) as `rank`'s checkpoint directory and stages it.
  RankCheckpoint StageRank(int rank, uint64_t round,
                           const std::map<std::string, std::string>& files) {
    const std::string src = Path("src" + std::to_string(next_src_++));
    fs::create_directories(src);
    for (const auto& [rel, contents] : files) WriteTestFile(JoinPath(src, rel), contents);
    RankCheckpoint rc{.rank = rank, .staging_dir = StagingPath(run_, 1, round, rank)};
    auto entries = StageDirectory(src, rc.staging_dir);
    EXPECT_TRUE(entries.ok()) << entries.status().ToString();
    if (entries.ok()) rc.files = *entries;
    return rc;
  }

  // Commits a one-rank checkpoint holding `file_name`.
  CheckpointRecord CommitOne(const std::string& dir_name, uint64_t round,
                             const std::string& metrics_json,
                             const std::string& file_name = "model.bin") {
    auto record =
        CommitCheckpoint(run_, dir_name, round, 100.0 + static_cast<double>(round), metrics_json,
                         {StageRank(0, round, {{file_name, "r" + std::to_string(round)}})});
    EXPECT_TRUE(record.ok()) << record.status().ToString();
    return record.ok() ? *record : CheckpointRecord{};
  }

  std::string Dir(const std::string& dir_name) const { return JoinPath(run_, dir_name); }

  std::string run_;
  int next_src_ = 0;
};

TEST_F(CommitTest, CommitsEveryRanksFilesAndTheManifest) {
  RankCheckpoint rank0 = StageRank(0, 3, {{"model.bin", "weights"}, {"shared/a.txt", "aaa"}});
  RankCheckpoint rank1 = StageRank(1, 3, {{"rank1.bin", "xyz"}, {"shared/b.txt", "bbbb"}});

  auto record = CommitCheckpoint(run_, "checkpoint_000003", 3, 12.5,
                                 R"({"loss": 0.25, "acc": NaN, "eval": {"x": 1}})", {rank0, rank1});
  ASSERT_TRUE(record.ok()) << record.status().ToString();
  EXPECT_EQ(record->dir_name, "checkpoint_000003");
  EXPECT_EQ(record->round, 3u);
  EXPECT_EQ(record->time, 12.5);
  EXPECT_EQ(record->bytes, 7u + 3u + 3u + 4u);
  EXPECT_EQ(record->files, 4u);
  EXPECT_EQ(record->metrics, json::parse(R"({"loss": 0.25, "acc": "NaN", "eval": {"x": 1}})"));

  const std::string dir = Dir("checkpoint_000003");
  EXPECT_EQ(ListFiles(dir),
            Sorted({kManifestName, "model.bin", "rank1.bin", "shared/a.txt", "shared/b.txt"}));
  EXPECT_EQ(ReadTestFile(JoinPath(dir, "model.bin")), "weights");
  EXPECT_EQ(ReadTestFile(JoinPath(dir, "shared/a.txt")), "aaa");
  EXPECT_EQ(ReadTestFile(JoinPath(dir, "rank1.bin")), "xyz");
  EXPECT_EQ(ReadTestFile(JoinPath(dir, "shared/b.txt")), "bbbb");

  EXPECT_FALSE(Exists(rank0.staging_dir));
  EXPECT_FALSE(Exists(rank1.staging_dir));
  EXPECT_EQ(ListEntries(JoinPath(run_, kStagingDir)), std::vector<std::string>{});

  auto read = ReadCheckpointRecord(dir);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->dir_name, "checkpoint_000003");
  EXPECT_EQ(read->round, 3u);
  EXPECT_EQ(read->time, 12.5);
  EXPECT_EQ(read->bytes, 17u);
  EXPECT_EQ(read->files, 4u);
  EXPECT_EQ(read->metrics, record->metrics);

  Status verified = VerifyCheckpoint(dir, /*checksums=*/true);
  EXPECT_TRUE(verified.ok()) << verified.ToString();
}

TEST_F(CommitTest, TheManifestListsThePartsCopyIds) {
  RankCheckpoint rank0 = StageRank(0, 2, {{"a.bin", "a"}});
  RankCheckpoint rank1 = StageRank(1, 2, {{"b.bin", "b"}});
  RankCheckpoint rank2 = StageRank(2, 2, {{"c.bin", "c"}});
  rank0.copy_id = "0f3a";
  rank2.copy_id = "77-b";
  ASSERT_TRUE(
      CommitCheckpoint(run_, "checkpoint_000002", 2, 1.0, "{}", {rank0, rank1, rank2}).ok());
  json manifest = json::parse(ReadTestFile(JoinPath(Dir("checkpoint_000002"), kManifestName)));
  EXPECT_EQ(manifest["copies"],
            json::parse(R"([{"rank": 0, "id": "0f3a"}, {"rank": 2, "id": "77-b"}])"));
  // Without any, the manifest has none.
  CommitOne("checkpoint_000003", 3, "{}");
  EXPECT_FALSE(json::parse(ReadTestFile(JoinPath(Dir("checkpoint_000003"), kManifestName)))
                   .contains("copies"));
}

TEST_F(CommitTest, TheManifestCarriesTheSha256OfFilesStagedWithHash) {
  fs::create_directories(Path("src-hashed"));
  WriteTestFile(Path("src-hashed/a.bin"), "abc");
  RankCheckpoint rank0{.rank = 0, .staging_dir = StagingPath(run_, 1, 2, 0)};
  auto entries = StageDirectory(Path("src-hashed"), rank0.staging_dir, true, /*hash=*/true);
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  rank0.files = *entries;
  RankCheckpoint rank1 = StageRank(1, 2, {{"b.bin", "b"}});  // staged without: none
  ASSERT_TRUE(CommitCheckpoint(run_, "checkpoint_000002", 2, 1.0, "{}", {rank0, rank1}).ok());
  json manifest = json::parse(ReadTestFile(JoinPath(Dir("checkpoint_000002"), kManifestName)));
  for (const auto& f : manifest["file_list"]) {
    if (f["path"] == "a.bin") {
      EXPECT_EQ(f["sha256"], kSha256Abc);
    } else {
      EXPECT_FALSE(f.contains("sha256"));
    }
  }
  auto read = ManifestEntries(manifest);
  ASSERT_TRUE(read.has_value());
  for (const auto& e : *read) EXPECT_EQ(e.sha256, e.path == "a.bin" ? kSha256Abc : "");
  // A manifest whose sha256 is not one is damaged.
  manifest["file_list"][0]["sha256"] = "not-hex";
  EXPECT_FALSE(ManifestEntries(manifest).has_value());
}

TEST_F(CommitTest, PartsInTheStoreCommitTheManifestAloneMarkedAsInTheStore) {
  RankCheckpoint rank0{.rank = 0,
                       .files = {{.path = "model.bin",
                                  .size = 7,
                                  .crc32c = 11,
                                  .sha256 = std::string(kSha256HexSize, 'a')},
                                 {.path = "latest", .mode = 0777, .link = "model.bin"}},
                       .in_store = true};
  RankCheckpoint rank1{
      .rank = 1, .files = {{.path = "shard/1.bin", .size = 5, .crc32c = 22}}, .in_store = true};
  auto record = CommitCheckpoint(run_, "checkpoint_000004", 4, 2.0, "{}", {rank0, rank1});
  ASSERT_TRUE(record.ok()) << record.status().ToString();
  EXPECT_EQ(record->bytes, 12u);
  EXPECT_EQ(record->files, 3u);
  const std::string dir = Dir("checkpoint_000004");
  // Nothing was staged here and nothing is moved: the directory holds the manifest only.
  EXPECT_EQ(ListFiles(dir), std::vector<std::string>{kManifestName});
  json manifest = json::parse(ReadTestFile(JoinPath(dir, kManifestName)));
  EXPECT_TRUE(InStore(manifest));
  EXPECT_EQ(manifest["file_list"].size(), 2u);
  EXPECT_EQ(manifest["file_list"][1]["rank"], 1);
  EXPECT_EQ(manifest["links"][0]["target"], "model.bin");
  // Its files are checked by the ranks that download them; here only its form.
  Status verified = VerifyCheckpoint(dir, /*checksums=*/true);
  EXPECT_TRUE(verified.ok()) << verified.ToString();
  manifest["file_list"][0]["path"] = "../x";
  WriteTestFile(JoinPath(dir, kManifestName), manifest.dump());
  EXPECT_EQ(VerifyCheckpoint(dir, true).code(), StatusCode::kDataLoss);
  // A staged manifest is not in the store.
  CommitOne("checkpoint_000005", 5, "{}");
  EXPECT_FALSE(
      InStore(json::parse(ReadTestFile(JoinPath(Dir("checkpoint_000005"), kManifestName)))));
}

TEST_F(CommitTest, APartInTheStoreIsRefusedWithAStagingDirABadPathOrAStagedPartBeside) {
  RankCheckpoint stored{.rank = 1, .files = {{.path = "b.bin", .size = 1}}, .in_store = true};
  RankCheckpoint staged = StageRank(0, 6, {{"a.bin", "a"}});
  auto mixed = CommitCheckpoint(run_, "checkpoint_000006", 6, 1.0, "{}", {staged, stored});
  EXPECT_EQ(mixed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("rank 1's part"), std::string::npos);
  EXPECT_FALSE(Exists(Dir("checkpoint_000006")));

  RankCheckpoint named = stored;
  named.staging_dir = StagingPath(run_, 1, 6, 1);
  EXPECT_NE(CommitCheckpoint(run_, "c", 6, 1.0, "{}", {named})
                .status()
                .message()
                .find("names the staging directory"),
            std::string::npos);
  RankCheckpoint climbing = stored;
  climbing.files[0].path = "../outside";
  EXPECT_NE(CommitCheckpoint(run_, "c", 6, 1.0, "{}", {climbing})
                .status()
                .message()
                .find("not a clean relative path"),
            std::string::npos);
  RankCheckpoint link_out = stored;
  link_out.files[0].link = "../../etc/passwd";
  EXPECT_NE(CommitCheckpoint(run_, "c", 6, 1.0, "{}", {link_out})
                .status()
                .message()
                .find("not a link inside the checkpoint"),
            std::string::npos);
  EXPECT_FALSE(Exists(Dir("c")));
}

TEST_F(CommitTest, RanksStagedFromParallelThreadsCommitTogether) {
  constexpr int kRanks = 4;
  std::vector<std::string> sources(kRanks);
  std::vector<StatusOr<std::vector<FileEntry>>> staged(kRanks, InternalError("not run"));
  for (int r = 0; r < kRanks; ++r) {
    sources[r] = Path("src_rank" + std::to_string(r));
    WriteTestFile(JoinPath(sources[r], "shard-" + std::to_string(r) + ".bin"), Pattern(1000, r));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back(
        [&, r] { staged[r] = StageDirectory(sources[r], StagingPath(run_, 1, 9, r)); });
  }
  for (auto& t : threads) t.join();

  std::vector<RankCheckpoint> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(staged[r].ok()) << staged[r].status().ToString();
    ranks.push_back({.rank = r, .staging_dir = StagingPath(run_, 1, 9, r), .files = *staged[r]});
  }
  auto record = CommitCheckpoint(run_, "ckpt", 9, 1.0, "{}", ranks);
  ASSERT_TRUE(record.ok()) << record.status().ToString();
  EXPECT_EQ(record->files, 4u);
  EXPECT_EQ(record->bytes, 4000u);
  EXPECT_EQ(ListFiles(Dir("ckpt")),
            Sorted({kManifestName, "shard-0.bin", "shard-1.bin", "shard-2.bin", "shard-3.bin"}));
  EXPECT_TRUE(VerifyCheckpoint(Dir("ckpt"), /*checksums=*/true).ok());
}

TEST_F(CommitTest, TwoRanksWritingTheSameFileIsInvalidArgumentNamingBothAndTheFile) {
  RankCheckpoint rank0 = StageRank(0, 5, {{"model.bin", "a"}, {"only0.txt", "0"}});
  RankCheckpoint rank3 = StageRank(3, 5, {{"model.bin", "b"}});

  auto record = CommitCheckpoint(run_, "ckpt", 5, 1.0, "{}", {rank0, rank3});
  EXPECT_EQ(record.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(record.status().message(), "rank 0"));
  EXPECT_TRUE(HasText(record.status().message(), "rank 3"));
  EXPECT_TRUE(HasText(record.status().message(), "'model.bin'"));
  EXPECT_FALSE(Exists(Dir("ckpt")));
}

TEST_F(CommitTest, AFileNamedLikeTheManifestIsInvalidArgument) {
  RankCheckpoint rank0 = StageRank(0, 5, {{"model.bin", "a"}});
  RankCheckpoint rank1 = StageRank(1, 5, {{kManifestName, "{}"}});

  auto record = CommitCheckpoint(run_, "ckpt", 5, 1.0, "{}", {rank0, rank1});
  EXPECT_EQ(record.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasText(record.status().message(), "rank 1"));
  EXPECT_TRUE(HasText(record.status().message(), kManifestName));
  EXPECT_FALSE(Exists(Dir("ckpt")));
}

TEST_F(CommitTest, DirNameThatIsNotOnePlainNameIsInvalidArgument) {
  for (const std::string name :
       {"", ".", "..", "a/b", "/abs", ".hidden", ".staging", "logs", "checkpoints.json"}) {
    SCOPED_TRACE("dir_name='" + name + "'");
    RankCheckpoint rank0 = StageRank(0, 1, {{"model.bin", "a"}});
    auto record = CommitCheckpoint(run_, name, 1, 1.0, "{}", {rank0});
    EXPECT_EQ(record.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasText(record.status().message(), "checkpoint_dir_name='" + name + "'"));
    EXPECT_TRUE(Exists(JoinPath(rank0.staging_dir, "model.bin")));
  }
  EXPECT_FALSE(Exists(Dir("a")));
  EXPECT_FALSE(Exists(Dir("logs")));
  EXPECT_FALSE(Exists(Dir("checkpoints.json")));
  EXPECT_FALSE(Exists(Dir(".hidden")));
}

TEST_F(CommitTest, RecommittingANameReplacesItsContentsWithTheSecondCommitsFiles) {
  ASSERT_TRUE(CommitCheckpoint(run_, "ckpt", 1, 1.0, R"({"loss": 2})",
                               {StageRank(0, 1, {{"old.bin", "old"}, {"common.txt", "v1"}})})
                  .ok());
  auto second = CommitCheckpoint(run_, "ckpt", 2, 2.0, R"({"loss": 1})",
                                 {StageRank(0, 2, {{"new.bin", "new!"}, {"common.txt", "v2"}})});
  ASSERT_TRUE(second.ok()) << second.status().ToString();

  EXPECT_EQ(ListFiles(Dir("ckpt")), Sorted({kManifestName, "common.txt", "new.bin"}));
  EXPECT_EQ(ReadTestFile(JoinPath(Dir("ckpt"), "common.txt")), "v2");
  EXPECT_EQ(ReadTestFile(JoinPath(Dir("ckpt"), "new.bin")), "new!");
  auto read = ReadCheckpointRecord(Dir("ckpt"));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->round, 2u);
  EXPECT_EQ(read->files, 2u);
  EXPECT_EQ(read->bytes, 6u);
  EXPECT_EQ(read->metrics, json::parse(R"({"loss": 1})"));
  EXPECT_TRUE(VerifyCheckpoint(Dir("ckpt"), /*checksums=*/true).ok());
  // Neither the old contents nor the new ones are left behind in staging.
  EXPECT_EQ(ListEntries(JoinPath(run_, kStagingDir)), std::vector<std::string>{});
  EXPECT_EQ(ListEntries(run_), Sorted({kStagingDir, "ckpt"}));
}

TEST_F(CommitTest, MetricsThatAreNotAJsonObjectAreRecordedAsEmpty) {
  for (const std::string metrics : {"not json", "[1, 2]", "3"}) {
    SCOPED_TRACE(metrics);
    CheckpointRecord record = CommitOne("ckpt", 1, metrics);
    EXPECT_EQ(record.metrics, json::object());
    auto read = ReadCheckpointRecord(Dir("ckpt"));
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(read->metrics, json::object());
  }
}

TEST_F(CommitTest, KeepsModesAndInsideLinksAndTheManifestRecordsThem) {
  ScopedUmask mask(022);
  const std::string src = Path("modes_src");
  WriteTestFile(JoinPath(src, "keys/secret.key"), "token");
  fs::permissions(JoinPath(src, "keys/secret.key"), fs::perms(0600));
  fs::permissions(JoinPath(src, "keys"), fs::perms(0700));
  fs::create_symlink("keys/secret.key", JoinPath(src, "current.key"));
  RankCheckpoint rc{.rank = 0, .staging_dir = StagingPath(run_, 1, 2, 0)};
  auto entries = StageDirectory(src, rc.staging_dir);
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  rc.files = *entries;
  auto record = CommitCheckpoint(run_, "ckpt", 2, 1.0, "{}", {rc});
  ASSERT_TRUE(record.ok()) << record.status().ToString();

  const std::string dir = Dir("ckpt");
  EXPECT_EQ(ModeOf(JoinPath(dir, "keys/secret.key")), 0600u);
  EXPECT_EQ(ModeOf(JoinPath(dir, "keys")), 0700u);
  EXPECT_EQ(fs::read_symlink(JoinPath(dir, "current.key")).string(), "keys/secret.key");
  json manifest = json::parse(ReadTestFile(JoinPath(dir, kManifestName)));
  ASSERT_EQ(manifest["file_list"].size(), 1u);
  EXPECT_EQ(manifest["file_list"][0]["path"], "keys/secret.key");
  EXPECT_EQ(manifest["file_list"][0]["mode"], 0600);
  ASSERT_EQ(manifest["links"].size(), 1u);
  EXPECT_EQ(manifest["links"][0]["path"], "current.key");
  EXPECT_EQ(manifest["links"][0]["target"], "keys/secret.key");
  ASSERT_EQ(manifest["dirs"].size(), 1u);
  EXPECT_EQ(manifest["dirs"][0]["path"], "keys");
  EXPECT_EQ(manifest["dirs"][0]["mode"], 0700);
  EXPECT_TRUE(VerifyCheckpoint(dir, /*checksums=*/true).ok());

  // A link replaced after the commit no longer verifies.
  fs::remove(JoinPath(dir, "current.key"));
  fs::create_symlink("/etc/passwd", JoinPath(dir, "current.key"));
  Status s = VerifyCheckpoint(dir, /*checksums=*/true);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(HasText(s.message(), "current.key"));
}

// A worker's message names its staging directory and its files; a wrong one must never make the
// controller move, follow or delete anything outside the run's staging area.
class StagedPartTest : public CommitTest {
 protected:
  void SetUp() override {
    CommitTest::SetUp();
    WriteTestFile(Path("victim/precious.bin"), "keep me");
  }
  void ExpectRefusedAndVictimKept(const RankCheckpoint& rc, const std::string& text) {
    auto record = CommitCheckpoint(run_, "ckpt", 1, 1.0, "{}", {rc});
    EXPECT_EQ(record.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasText(record.status().message(), text));
    EXPECT_TRUE(HasText(record.status().message(), "rank 0"));
    EXPECT_EQ(ReadTestFile(Path("victim/precious.bin")), "keep me");
    EXPECT_FALSE(Exists(Dir("ckpt")));
  }
};

TEST_F(StagedPartTest, AStagingDirectoryOutsideTheRunsStagingIsRefusedAndNotDeleted) {
  RankCheckpoint rc{.rank = 0,
                    .staging_dir = Path("victim"),
                    .files = {{.path = "precious.bin", .size = 7, .crc32c = CrcOf("keep me")}}};
  ExpectRefusedAndVictimKept(rc, "'" + Path("victim") + "'");
  rc.staging_dir = JoinPath(run_, ".staging/../../victim");
  ExpectRefusedAndVictimKept(rc, "not a directory directly under");
  rc.staging_dir = JoinPath(run_, ".staging");
  ExpectRefusedAndVictimKept(rc, "not a directory directly under");
}

TEST_F(StagedPartTest, AStagingDirectoryThatIsASymlinkIsRefusedAndNotDeleted) {
  fs::create_directories(JoinPath(run_, ".staging"));
  const std::string link = StagingPath(run_, 1, 1, 0);
  fs::create_directory_symlink(Path("victim"), link);
  RankCheckpoint rc{.rank = 0,
                    .staging_dir = link,
                    .files = {{.path = "precious.bin", .size = 7, .crc32c = CrcOf("keep me")}}};
  ExpectRefusedAndVictimKept(rc, "symbolic link");
}

TEST_F(StagedPartTest, FilePathsWithDotDotOrAbsoluteAreRefused) {
  RankCheckpoint rc = StageRank(0, 1, {{"model.bin", "m"}});
  for (const std::string& bad :
       std::vector<std::string>{"../../victim/precious.bin", Path("victim/precious.bin"),
                                std::string("a/./b"), std::string("")}) {
    SCOPED_TRACE(bad);
    RankCheckpoint forged = rc;
    forged.files.push_back({.path = bad, .size = 7});
    ExpectRefusedAndVictimKept(forged, "not a clean relative path");
    EXPECT_TRUE(Exists(JoinPath(rc.staging_dir, "model.bin")));
  }
}

TEST_F(StagedPartTest, ASha256ThatIsNot64LowercaseHexDigitsIsRefused) {
  RankCheckpoint rc = StageRank(0, 1, {{"model.bin", "m"}});
  for (const std::string& bad :
       {std::string("abc"), std::string(64, 'A'), std::string(64, 'g'), std::string(65, 'a')}) {
    SCOPED_TRACE(bad);
    RankCheckpoint forged = rc;
    forged.files[0].sha256 = bad;
    ExpectRefusedAndVictimKept(forged, "not 64 lowercase hexadecimal digits");
  }
}

TEST_F(StagedPartTest, AFileReachedThroughASymlinkedParentIsRefused) {
  RankCheckpoint rc = StageRank(0, 1, {{"model.bin", "m"}});
  fs::create_directory_symlink(Path("victim"), JoinPath(rc.staging_dir, "sub"));
  rc.files.push_back({.path = "sub/precious.bin", .size = 7, .crc32c = CrcOf("keep me")});
  ExpectRefusedAndVictimKept(rc, "'sub/precious.bin'");
}

TEST_F(StagedPartTest, AFileListedAsAFileThatIsALinkIsRefused) {
  RankCheckpoint rc = StageRank(0, 1, {{"model.bin", "m"}});
  fs::create_symlink(Path("victim/precious.bin"), JoinPath(rc.staging_dir, "stolen.bin"));
  rc.files.push_back({.path = "stolen.bin", .size = 7, .crc32c = CrcOf("keep me")});
  ExpectRefusedAndVictimKept(rc, "not a regular file");
  rc.files.back().link = Path("victim/precious.bin");
  ExpectRefusedAndVictimKept(rc, "not a link inside the checkpoint");
}

TEST_F(CommitTest, ReadCheckpointRecordOfADirectoryWithoutManifestIsNotFound) {
  WriteTestFile(Path("run/not_a_checkpoint/model.bin"), "x");
  auto read = ReadCheckpointRecord(Dir("not_a_checkpoint"));
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasText(read.status().message(), Dir("not_a_checkpoint")));
  EXPECT_EQ(ReadCheckpointRecord(Dir("missing")).status().code(), StatusCode::kNotFound);
}

TEST_F(CommitTest, ReadCheckpointRecordOfADamagedManifestIsDataLoss) {
  CommitOne("ckpt", 1, "{}");
  WriteTestFile(JoinPath(Dir("ckpt"), kManifestName), "{\"round\": 1,");
  auto read = ReadCheckpointRecord(Dir("ckpt"));
  EXPECT_EQ(read.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(HasText(read.status().message(), Dir("ckpt")));
}

// A damaged manifest must come back as an error value, not as an exception out of nlohmann::json.
TEST_F(CommitTest, ReadCheckpointRecordOfAManifestWithWrongTypesIsDataLoss) {
  CommitOne("ckpt", 1, "{}");
  for (const char* manifest : {R"({"round": "one"})", R"({"dir_name": 7})", R"({"time": []})"}) {
    SCOPED_TRACE(manifest);
    WriteTestFile(JoinPath(Dir("ckpt"), kManifestName), manifest);
    try {
      auto read = ReadCheckpointRecord(Dir("ckpt"));
      EXPECT_EQ(read.status().code(), StatusCode::kDataLoss);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "ReadCheckpointRecord threw: " << e.what();
    }
  }
}

// --- VerifyCheckpoint ----------------------------------------------------------------------------

class VerifyTest : public CommitTest {
 protected:
  void SetUp() override {
    CommitTest::SetUp();
    ASSERT_TRUE(CommitCheckpoint(run_, "ckpt", 1, 1.0, "{}",
                                 {StageRank(0, 1, {{"model.bin", "0123456789"}}),
                                  StageRank(1, 1, {{"sub/rank1.bin", "abc"}})})
                    .ok());
    dir_ = Dir("ckpt");
  }

  std::string dir_;
};

TEST_F(VerifyTest, IntactCheckpointIsOkWithAndWithoutChecksums) {
  EXPECT_TRUE(VerifyCheckpoint(dir_, /*checksums=*/false).ok());
  EXPECT_TRUE(VerifyCheckpoint(dir_, /*checksums=*/true).ok());
}

TEST_F(VerifyTest, TruncatedFileIsDataLossNamingTheFileAndBothSizes) {
  fs::resize_file(JoinPath(dir_, "model.bin"), 4);
  for (bool checksums : {false, true}) {
    Status s = VerifyCheckpoint(dir_, checksums);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_TRUE(HasText(s.message(), JoinPath(dir_, "model.bin")));
    EXPECT_TRUE(HasText(s.message(), "has 4 bytes"));
    EXPECT_TRUE(HasText(s.message(), "says 10"));
  }
}

TEST_F(VerifyTest, FlippedByteIsDataLossOnlyWithChecksums) {
  const std::string path = JoinPath(dir_, "model.bin");
  std::string contents = ReadTestFile(path);
  contents[5] ^= 0x01;
  WriteTestFile(path, contents);

  EXPECT_TRUE(VerifyCheckpoint(dir_, /*checksums=*/false).ok());
  Status s = VerifyCheckpoint(dir_, /*checksums=*/true);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(HasText(s.message(), path));
  EXPECT_TRUE(HasText(s.message(), "checksum"));
}

TEST_F(CommitTest, VerifyOnManyThreadsFindsTheOneFlippedByteAmongManyFiles) {
  std::map<std::string, std::string> files;
  for (int i = 0; i < 24; ++i) files["f" + std::to_string(i) + ".bin"] = Pattern(3000 + i, i);
  ASSERT_TRUE(CommitCheckpoint(run_, "many", 1, 1.0, "{}", {StageRank(0, 1, files)}).ok());
  for (int threads : {1, 4, 0}) EXPECT_TRUE(VerifyCheckpoint(Dir("many"), true, threads).ok());
  const std::string path = JoinPath(Dir("many"), "f17.bin");
  std::string contents = ReadTestFile(path);
  contents[100] ^= 0x40;
  WriteTestFile(path, contents);
  for (int threads : {1, 4, 0}) {
    Status s = VerifyCheckpoint(Dir("many"), true, threads);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_TRUE(HasText(s.message(), path));
  }
}

TEST_F(VerifyTest, MissingFileIsDataLossNamingTheFile) {
  const std::string path = JoinPath(dir_, "sub/rank1.bin");
  ASSERT_TRUE(fs::remove(path));
  Status s = VerifyCheckpoint(dir_, /*checksums=*/false);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(HasText(s.message(), path));
  EXPECT_TRUE(HasText(s.message(), "missing"));
}

TEST_F(VerifyTest, DirectoryWithoutManifestIsNotFound) {
  ASSERT_TRUE(fs::remove(JoinPath(dir_, kManifestName)));
  Status s = VerifyCheckpoint(dir_, /*checksums=*/true);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(HasText(s.message(), dir_));
  EXPECT_EQ(VerifyCheckpoint(Dir("never_committed"), true).code(), StatusCode::kNotFound);
}

TEST_F(VerifyTest, ManifestThatIsNotJsonOrHasNoFileListIsDataLoss) {
  for (const char* manifest : {"{", "[]", R"({"round": 1})"}) {
    SCOPED_TRACE(manifest);
    WriteTestFile(JoinPath(dir_, kManifestName), manifest);
    Status s = VerifyCheckpoint(dir_, /*checksums=*/true);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
    EXPECT_TRUE(HasText(s.message(), dir_));
  }
}

// A damaged manifest must come back as an error value, not as an exception out of nlohmann::json.
TEST_F(VerifyTest, ManifestWithWrongTypesIsDataLoss) {
  for (const char* manifest : {R"({"file_list": [5]})", R"({"file_list": [{"path": 5}]})",
                               R"({"file_list": [{"path": "model.bin", "size": "ten"}]})"}) {
    SCOPED_TRACE(manifest);
    WriteTestFile(JoinPath(dir_, kManifestName), manifest);
    Status s = OkStatus();
    try {
      s = VerifyCheckpoint(dir_, /*checksums=*/true);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "VerifyCheckpoint threw: " << e.what();
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  }
}

// --- CheckpointIndex -----------------------------------------------------------------------------

class CheckpointIndexTest : public CommitTest {
 protected:
  CheckpointIndex LoadIndex(std::vector<std::string>* warnings) {
    warnings->clear();
    auto index = CheckpointIndex::Load(run_, warnings);
    EXPECT_TRUE(index.ok()) << index.status().ToString();
    return index.ok() ? *index : CheckpointIndex();
  }

  std::string IndexPath() const { return JoinPath(run_, "checkpoints.json"); }
};

TEST_F(CheckpointIndexTest, EmptyRunDirectoryLoadsNoRecordsAndNoWarnings) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  EXPECT_TRUE(index.records().empty());
  EXPECT_TRUE(warnings.empty());
}

TEST_F(CheckpointIndexTest, AddRemoveSaveLoadRoundTripKeepsOrderAndMetrics) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  // Names in the reverse of their order, so that only the index can give the order back.
  CheckpointRecord z = CommitOne("ckpt_z", 1, R"({"loss": 3, "eval": {"acc": 0.5}})");
  CheckpointRecord y = CommitOne("ckpt_y", 2, R"({"loss": 2})");
  CheckpointRecord x = CommitOne("ckpt_x", 3, R"({"loss": NaN})");
  index.Add(z);
  index.Add(y);
  index.Add(x);
  EXPECT_EQ(Names(index.records()), (std::vector<std::string>{"ckpt_z", "ckpt_y", "ckpt_x"}));
  index.Remove("ckpt_y");
  ASSERT_TRUE(RemoveTree(Dir("ckpt_y")).ok());
  EXPECT_EQ(Names(index.records()), (std::vector<std::string>{"ckpt_z", "ckpt_x"}));
  Status saved = index.Save();
  ASSERT_TRUE(saved.ok()) << saved.ToString();

  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_EQ(warnings, std::vector<std::string>{});
  ASSERT_EQ(Names(loaded.records()), (std::vector<std::string>{"ckpt_z", "ckpt_x"}));
  for (size_t i = 0; i < 2; ++i) {
    const CheckpointRecord& want = i == 0 ? z : x;
    const CheckpointRecord& got = loaded.records()[i];
    SCOPED_TRACE(want.dir_name);
    EXPECT_EQ(got.round, want.round);
    EXPECT_EQ(got.time, want.time);
    EXPECT_EQ(got.bytes, want.bytes);
    EXPECT_EQ(got.files, want.files);
    EXPECT_EQ(got.metrics, want.metrics);
  }
  EXPECT_EQ(loaded.records()[0].metrics["eval"]["acc"], 0.5);
  EXPECT_EQ(loaded.records()[1].metrics["loss"], "NaN");
}

TEST_F(CheckpointIndexTest, AddingAnExistingNameReplacesItAsTheNewest) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  index.Add({.dir_name = "a", .round = 1});
  index.Add({.dir_name = "b", .round = 2});
  index.Add({.dir_name = "a", .round = 3});
  EXPECT_EQ(Names(index.records()), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(index.records().back().round, 3u);
  index.Remove("not_there");
  EXPECT_EQ(index.records().size(), 2u);
}

TEST_F(CheckpointIndexTest, SaveWritesTheLatestCheckpointName) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  index.Add(CommitOne("first", 1, "{}"));
  index.Add(CommitOne("second", 2, "{}"));
  ASSERT_TRUE(index.Save().ok());
  json saved = json::parse(ReadTestFile(IndexPath()));
  EXPECT_EQ(saved["latest"], "second");
  EXPECT_EQ(saved["checkpoints"].size(), 2u);
}

TEST_F(CheckpointIndexTest, LoadForgetsAnEntryWhoseDirectoryWasDeleted) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  index.Add(CommitOne("gone", 1, "{}"));
  index.Add(CommitOne("kept", 2, "{}"));
  ASSERT_TRUE(index.Save().ok());
  fs::remove_all(Dir("gone"));

  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_EQ(Names(loaded.records()), std::vector<std::string>{"kept"});
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(HasText(warnings[0], "'gone'"));
}

TEST_F(CheckpointIndexTest, LoadForgetsAnEntryWhoseManifestWasDeleted) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  index.Add(CommitOne("half", 1, "{}"));
  index.Add(CommitOne("kept", 2, "{}"));
  ASSERT_TRUE(index.Save().ok());
  ASSERT_TRUE(fs::remove(JoinPath(Dir("half"), kManifestName)));

  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_EQ(Names(loaded.records()), std::vector<std::string>{"kept"});
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(HasText(warnings[0], "'half'"));
}

TEST_F(CheckpointIndexTest, LoadAddsCommittedDirectoriesMissingFromTheIndexInRoundOrder) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  index.Add(CommitOne("ckpt_c", 1, R"({"loss": 3})"));
  ASSERT_TRUE(index.Save().ok());
  // Committed after the index was last saved (a crash between commit and Save).
  CommitOne("ckpt_a", 3, R"({"loss": 1})");
  CommitOne("ckpt_b", 2, R"({"loss": 2})");

  CheckpointIndex loaded = LoadIndex(&warnings);
  ASSERT_EQ(Names(loaded.records()), (std::vector<std::string>{"ckpt_c", "ckpt_b", "ckpt_a"}));
  EXPECT_EQ(loaded.records()[1].round, 2u);
  EXPECT_EQ(loaded.records()[1].metrics, json::parse(R"({"loss": 2})"));
  EXPECT_EQ(loaded.records()[2].round, 3u);
  EXPECT_EQ(loaded.records()[2].time, 103.0);
  EXPECT_EQ(loaded.records()[2].files, 1u);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_TRUE(HasText(warnings[0] + warnings[1], "'ckpt_a'"));
  EXPECT_TRUE(HasText(warnings[0] + warnings[1], "'ckpt_b'"));
}

TEST_F(CheckpointIndexTest, LoadWithoutAnIndexRebuildsItFromTheDirectoriesInRoundOrder) {
  CommitOne("ckpt_c", 1, "{}");
  CommitOne("ckpt_a", 3, "{}");
  CommitOne("ckpt_b", 2, "{}");
  std::vector<std::string> warnings;
  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_EQ(Names(loaded.records()), (std::vector<std::string>{"ckpt_c", "ckpt_b", "ckpt_a"}));
  EXPECT_EQ(warnings.size(), 3u);
}

// The controller saves the index before deleting the checkpoints retention dropped; when that
// deletion fails or is interrupted, the next Load finds the old directory again. It is older than
// the indexed ones and must not become the newest (the one retention protects and a restart uses).
TEST_F(CheckpointIndexTest, LoadPlacesAnOlderUnindexedCheckpointBeforeTheNewerIndexedOnes) {
  std::vector<std::string> warnings;
  CheckpointIndex index = LoadIndex(&warnings);
  CommitOne("old", 1, "{}");
  index.Add(CommitOne("new", 2, "{}"));
  ASSERT_TRUE(index.Save().ok());

  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_EQ(Names(loaded.records()), (std::vector<std::string>{"old", "new"}));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(HasText(warnings[0], "'old'"));
}

TEST_F(CheckpointIndexTest, LoadIgnoresDirectoriesThatAreNotCommittedCheckpoints) {
  WriteTestFile(Path("run/logs/rank-0.log"), "hello");
  WriteTestFile(Path("run/junk/model.bin"), "no manifest");
  // An interrupted commit, complete with its manifest, still in staging.
  WriteTestFile(JoinPath(Path("run/.staging/commit-r1-x"), kManifestName), R"({"round": 1})");
  WriteTestFile(Path("run/result.jsonl"), "{}\n");
  std::vector<std::string> warnings;
  CheckpointIndex loaded = LoadIndex(&warnings);
  EXPECT_TRUE(loaded.records().empty());
  EXPECT_TRUE(warnings.empty());
}

TEST_F(CheckpointIndexTest, DamagedIndexIsDataLoss) {
  for (const char* text : {"", "{", "not json", "[]", R"({"version": 1})"}) {
    SCOPED_TRACE(text);
    WriteTestFile(IndexPath(), text);
    std::vector<std::string> warnings;
    auto index = CheckpointIndex::Load(run_, &warnings);
    EXPECT_EQ(index.status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE(HasText(index.status().message(), IndexPath()));
  }
}

// Valid JSON of the wrong shape is damage too, and must come back as an error value, not as an
// exception out of nlohmann::json.
TEST_F(CheckpointIndexTest, IndexWithWrongTypesIsDataLoss) {
  CommitOne("ckpt", 1, "{}");
  for (const char* text : {R"({"checkpoints": 5})", R"({"checkpoints": [5]})",
                           R"({"checkpoints": [{"dir_name": "ckpt", "round": "one"}]})"}) {
    SCOPED_TRACE(text);
    WriteTestFile(IndexPath(), text);
    std::vector<std::string> warnings;
    try {
      auto index = CheckpointIndex::Load(run_, &warnings);
      EXPECT_EQ(index.status().code(), StatusCode::kDataLoss);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "CheckpointIndex::Load threw: " << e.what();
    }
  }
}

// --- SelectForDeletion / RankByScore -------------------------------------------------------------

// Records c1..cN, oldest first, with `scores[i]` as the metric "score" (nullopt: not reported).
std::vector<CheckpointRecord> Records(const std::vector<std::optional<json>>& scores) {
  std::vector<CheckpointRecord> out;
  for (size_t i = 0; i < scores.size(); ++i) {
    CheckpointRecord r{.dir_name = "c" + std::to_string(i + 1), .round = i + 1};
    r.metrics = json::object();
    r.metrics["other"] = 1;
    if (scores[i]) r.metrics["score"] = *scores[i];
    out.push_back(r);
  }
  return out;
}

RetentionPolicy KeepBest(int n, bool higher_is_better) {
  return {.num_to_keep = n, .score_attribute = "score", .higher_is_better = higher_is_better};
}

TEST(RetentionTest, WithoutNumToKeepNothingIsDeleted) {
  auto records = Records({1, 2, 3, 4, 5});
  EXPECT_TRUE(SelectForDeletion(records, {}).empty());
  EXPECT_TRUE(SelectForDeletion(records, {.score_attribute = "score"}).empty());
}

TEST(RetentionTest, NoRecordsDeleteNothing) {
  EXPECT_TRUE(SelectForDeletion({}, {.num_to_keep = 1}).empty());
  EXPECT_TRUE(SelectForDeletion({}, KeepBest(1, true)).empty());
}

TEST(RetentionTest, ByRecencyKeepsTheNewest) {
  auto records = Records({5, 4, 3, 2, 1});
  EXPECT_EQ(Sorted(SelectForDeletion(records, {.num_to_keep = 2})),
            (std::vector<std::string>{"c1", "c2", "c3"}));
  EXPECT_EQ(Sorted(SelectForDeletion(records, {.num_to_keep = 1})),
            (std::vector<std::string>{"c1", "c2", "c3", "c4"}));
}

TEST(RetentionTest, KeepingAtLeastAsManyAsExistDeletesNothing) {
  auto records = Records({1, 2, 3});
  EXPECT_TRUE(SelectForDeletion(records, {.num_to_keep = 3}).empty());
  EXPECT_TRUE(SelectForDeletion(records, {.num_to_keep = 10}).empty());
  EXPECT_TRUE(SelectForDeletion(records, KeepBest(3, true)).empty());
}

TEST(RetentionTest, ByMaxScoreKeepsTheBestAndTheLatestEvenWhenItIsWorst) {
  auto records = Records({0.9, 0.5, 0.95, 0.7, 0.1});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(2, true))),
            (std::vector<std::string>{"c2", "c4"}));
}

TEST(RetentionTest, ByMinScoreKeepsTheBestAndTheLatestEvenWhenItIsWorst) {
  auto records = Records({0.2, 0.9, 0.1, 0.5, 3.0});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(2, false))),
            (std::vector<std::string>{"c2", "c4"}));
}

TEST(RetentionTest, LatestAmongTheBestIsNotKeptTwice) {
  auto records = Records({0.9, 0.5, 0.1, 0.95});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(2, true))),
            (std::vector<std::string>{"c2", "c3"}));
}

TEST(RetentionTest, RecordsWithoutTheScoreRankWorstInBothDirections) {
  auto records = Records({std::nullopt, 0.1, 0.3, std::nullopt, 0.2});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(3, true))),
            (std::vector<std::string>{"c1", "c4"}));
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(3, false))),
            (std::vector<std::string>{"c1", "c4"}));
  // A non-numeric score is no score.
  auto strings = Records({json("high"), 0.1, 0.2});
  EXPECT_EQ(SelectForDeletion(strings, KeepBest(2, true)), std::vector<std::string>{"c1"});
}

TEST(RetentionTest, NaNScoresRankWorstInBothDirections) {
  // "NaN" as ParseMetricsJson stores it, and a NaN double.
  auto records = Records({json("NaN"), 0.1, json(std::numeric_limits<double>::quiet_NaN()), 0.2});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(2, true))),
            (std::vector<std::string>{"c1", "c3"}));
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(2, false))),
            (std::vector<std::string>{"c1", "c3"}));
}

TEST(RetentionTest, InfiniteScoresRankAsInfinite) {
  auto records = Records({json("-Infinity"), 0.5, json("Infinity"), std::nullopt, 0.1});
  EXPECT_EQ(Names(RankByScore(records, KeepBest(1, true))),
            (std::vector<std::string>{"c3", "c2", "c5", "c1", "c4"}));
  EXPECT_EQ(Names(RankByScore(records, KeepBest(1, false))),
            (std::vector<std::string>{"c1", "c5", "c2", "c3", "c4"}));
}

TEST(RetentionTest, TiesKeepTheNewer) {
  auto records = Records({1.0, 1.0, 1.0, 0.5});
  EXPECT_EQ(SelectForDeletion(records, KeepBest(2, true)), std::vector<std::string>{"c1"});
  EXPECT_EQ(Names(RankByScore(records, KeepBest(2, true))),
            (std::vector<std::string>{"c3", "c2", "c1", "c4"}));
}

TEST(RetentionTest, ScoreAttributeMayBeNested) {
  std::vector<CheckpointRecord> records;
  for (double acc : {0.3, 0.9, 0.6}) {
    CheckpointRecord r{.dir_name = "c" + std::to_string(records.size() + 1),
                       .round = records.size() + 1};
    r.metrics = {{"eval", {{"acc", acc}}}};
    records.push_back(r);
  }
  RetentionPolicy policy{.num_to_keep = 1, .score_attribute = "eval/acc"};
  EXPECT_EQ(SelectForDeletion(records, policy), std::vector<std::string>{"c1"});
}

TEST(RankByScoreTest, WithoutAScoreAttributeIsNewestFirst) {
  auto records = Records({3, 1, 2});
  EXPECT_EQ(Names(RankByScore(records, {})), (std::vector<std::string>{"c3", "c2", "c1"}));
  EXPECT_EQ(Names(RankByScore(records, {.num_to_keep = 1})),
            (std::vector<std::string>{"c3", "c2", "c1"}));
}

TEST(RankByScoreTest, OrdersBestFirstWithMissingScoresLastNewestFirst) {
  auto records = Records({std::nullopt, 2, 1, std::nullopt, 3, 2});
  EXPECT_EQ(Names(RankByScore(records, KeepBest(1, true))),
            (std::vector<std::string>{"c5", "c6", "c2", "c3", "c4", "c1"}));
  EXPECT_EQ(Names(RankByScore(records, KeepBest(1, false))),
            (std::vector<std::string>{"c3", "c6", "c2", "c5", "c4", "c1"}));
}

TEST(RankByScoreTest, EmptyInputGivesEmptyOutput) {
  EXPECT_TRUE(RankByScore({}, KeepBest(1, true)).empty());
}

TEST(RetentionTest, PendingCheckpointsAreKeptAndTakeNoPlace) {
  // c2 and c3 wait for the validation that gives their score: neither counts as worst.
  auto records = Records({0.5, std::nullopt, std::nullopt, 0.9, 0.1});
  EXPECT_EQ(Sorted(SelectForDeletion(records, KeepBest(1, true), {"c2", "c3"})),
            (std::vector<std::string>{"c1"}));
}

// --- ApplyValidations ----------------------------------------------------------------------------

class ValidationsTest : public TempDirTest {};

TEST_F(ValidationsTest, MergesOutcomesAndFindsPendingRequests) {
  auto records = Records({0.1, 0.2, 0.3, 0.4});
  WriteTestFile(Path("validation.json"),
                R"({"checkpoints": {"c1": {"round": 1, "status": "validated",
                                           "metrics": {"score": 5, "acc": 0.7}},
                                    "c2": {"round": 9, "metrics": {"score": 6}},
                                    "c4": {"round": 4, "status": "failed", "error": "boom"}}})");
  WriteTestFile(Path("validation-requests/2.json"), "{}");  // c2's outcome is of another round
  WriteTestFile(Path("validation-requests/3.json"), "{}");
  WriteTestFile(Path("validation-requests/4.json"), "{}");
  Validations v = ApplyValidations(root_, records);
  EXPECT_EQ(v.records[0].metrics["score"], 5);
  EXPECT_EQ(v.records[0].metrics["acc"], 0.7);
  EXPECT_EQ(v.records[0].metrics["other"], 1);
  EXPECT_EQ(v.records[1].metrics["score"], 0.2);
  EXPECT_EQ(v.pending, (std::set<std::string>{"c2", "c3"}));
}

TEST_F(ValidationsTest, DamagedOrMissingRecordMeansNoOutcome) {
  auto records = Records({0.1});
  EXPECT_TRUE(ApplyValidations(root_, records).pending.empty());
  WriteTestFile(Path("validation.json"), "{not json");
  WriteTestFile(Path("validation-requests/1.json"), "{}");
  Validations v = ApplyValidations(root_, records);
  EXPECT_EQ(v.pending, std::set<std::string>{"c1"});
  EXPECT_EQ(v.records[0].metrics["score"], 0.1);
}

// --- RemoveTree ----------------------------------------------------------------------------------

class RemoveTreeTest : public TempDirTest {};

TEST_F(RemoveTreeTest, RemovesANestedTree) {
  WriteTestFile(Path("tree/a/b/c/file.bin"), "x");
  WriteTestFile(Path("tree/top.txt"), "y");
  fs::create_directories(Path("tree/empty/dir"));
  Status s = RemoveTree(Path("tree"));
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_FALSE(Exists(Path("tree")));
  EXPECT_TRUE(Exists(root_));
}

TEST_F(RemoveTreeTest, MissingPathIsOk) {
  EXPECT_TRUE(RemoveTree(Path("never_there")).ok());
  EXPECT_TRUE(RemoveTree(Path("never/there/either")).ok());
}

TEST_F(RemoveTreeTest, RemovesSymlinksWithoutFollowingThem) {
  WriteTestFile(Path("outside/precious.bin"), "keep me");
  fs::create_directories(Path("tree"));
  fs::create_directory_symlink(Path("outside"), Path("tree/link_to_dir"));
  fs::create_symlink(Path("outside/precious.bin"), Path("tree/link_to_file"));
  Status s = RemoveTree(Path("tree"));
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_FALSE(Exists(Path("tree")));
  EXPECT_EQ(ReadTestFile(Path("outside/precious.bin")), "keep me");
}

// --- crash points inside CommitCheckpoint
// ---------------------------------------------------------

// A commit stopped before each of its filesystem operations in turn, as a killed controller would
// stop: parameter true replaces a committed checkpoint of the same name (the exchange), false adds
// a new one (the rename).
class CommitCrashTest : public CommitTest, public ::testing::WithParamInterface<bool> {
 protected:
  // Round 2's checkpoint: two ranks, nested directories, a kept link.
  std::vector<RankCheckpoint> StageRound2() {
    RankCheckpoint rank0 =
        StageRank(0, 2, {{"model.bin", Pattern(3000, 2)}, {"shared/opt/a.bin", "a2"}});
    RankCheckpoint rank1 = StageRank(1, 2, {{"rank1.bin", "b2"}, {"shared/b.bin", "bb2"}});
    return {rank0, rank1};
  }

  std::string Round2Name() const { return GetParam() ? "checkpoint_000001" : "checkpoint_000002"; }

  // What every reader of the run sees must be whole checkpoints: the index (as the next start
  // loads it), each directory it names verified with checksums, and no other directory under a
  // checkpoint's name.
  void ExpectOnlyWholeCheckpoints(const std::string& when) {
    std::vector<std::string> warnings;
    auto index = CheckpointIndex::Load(run_, &warnings);
    ASSERT_TRUE(index.ok()) << when << ": " << index.status().ToString();
    ASSERT_FALSE(index->records().empty()) << when << ": the committed checkpoint is gone";
    for (const auto& r : index->records()) {
      Status verified = VerifyCheckpoint(Dir(r.dir_name), /*checksums=*/true);
      EXPECT_TRUE(verified.ok()) << when << ": " << verified.ToString();
      // The directory's own record: a reused name's index entry is updated after the commit.
      auto own = ReadCheckpointRecord(Dir(r.dir_name));
      ASSERT_TRUE(own.ok()) << when << ": " << own.status().ToString();
      const std::string model = ReadTestFile(JoinPath(Dir(r.dir_name), "model.bin"));
      EXPECT_EQ(model, own->round == 1 ? "r1" : Pattern(3000, 2)) << when << ": " << r.dir_name;
      if (own->round == 2) {
        EXPECT_EQ(ReadTestFile(JoinPath(Dir(r.dir_name), "shared/b.bin")), "bb2") << when;
      }
    }
    std::vector<std::string> visible;
    for (const auto& name : ListEntries(run_)) {
      if (name != kStagingDir && name != "checkpoints.json") visible.push_back(name);
    }
    EXPECT_EQ(visible, Sorted(Names(index->records()))) << when;
  }
};

TEST_P(CommitCrashTest, ACommitStoppedAtAnyStepLeavesOnlyWholeCheckpointsAndIsCleanedUpAfter) {
  // How many operations a whole commit performs.
  uint64_t total = 0;
  {
    CommitOne("checkpoint_000001", 1, R"({"loss": 1})");
    testing::FaultInjectingFileSystem counting;
    auto record = CommitCheckpoint(run_, Round2Name(), 2, 2.0, "{}", StageRound2(), counting);
    ASSERT_TRUE(record.ok()) << record.status().ToString();
    total = counting.operations();
    ASSERT_GT(total, 10u) << "the commit should be made of many steps";
    fs::remove_all(run_);
    fs::create_directories(run_);
  }
  for (uint64_t n = 0; n < total; ++n) {
    const std::string when =
        "crash at operation " + std::to_string(n) + " of " + std::to_string(total);
    CommitOne("checkpoint_000001", 1, R"({"loss": 1})");
    std::vector<std::string> warnings;
    auto before = CheckpointIndex::Load(run_, &warnings);
    ASSERT_TRUE(before.ok() && before->Save().ok()) << when;
    testing::FaultInjectingFileSystem crashing;
    crashing.CrashAt(n);
    auto record = CommitCheckpoint(run_, Round2Name(), 2, 2.0, "{}", StageRound2(), crashing);
    ASSERT_FALSE(record.ok()) << when;
    EXPECT_EQ(record.status().code(), StatusCode::kUnavailable) << when;
    ASSERT_TRUE(crashing.crashed()) << when;
    ExpectOnlyWholeCheckpoints(when);

    // The next attempt sweeps .staging/ (the controller's SweepStaging) and commits again.
    ASSERT_TRUE(RemoveTree(JoinPath(run_, kStagingDir)).ok());
    auto again = CommitCheckpoint(run_, Round2Name(), 2, 2.0, "{}", StageRound2());
    ASSERT_TRUE(again.ok()) << when << ": " << again.status().ToString();
    ExpectOnlyWholeCheckpoints(when + ", then committed again");
    EXPECT_TRUE(ListEntries(JoinPath(run_, kStagingDir)).empty()) << when;

    fs::remove_all(run_);
    fs::create_directories(run_);
  }
}

TEST_P(CommitCrashTest, TheNextCommitOfTheSameNameRemovesTheLeftoversOfAStoppedOne) {
  CommitOne("checkpoint_000001", 1, R"({"loss": 1})");
  testing::FaultInjectingFileSystem crashing;
  crashing.CrashAt(8);  // after the merge has begun: part of round 2 is in the commit directory
  ASSERT_FALSE(CommitCheckpoint(run_, Round2Name(), 2, 2.0, "{}", StageRound2(), crashing).ok());
  ASSERT_FALSE(ListEntries(JoinPath(run_, kStagingDir)).empty());
  // Without a sweep: the staging directories are written afresh and the commit replaces its own
  // interrupted directory.
  for (int rank : {0, 1}) ASSERT_TRUE(RemoveTree(StagingPath(run_, 1, 2, rank)).ok());
  auto again = CommitCheckpoint(run_, Round2Name(), 2, 2.0, "{}", StageRound2());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectOnlyWholeCheckpoints("committed after a stopped commit");
  EXPECT_TRUE(ListEntries(JoinPath(run_, kStagingDir)).empty());
}

TEST_F(CommitTest, AnIndexSaveStoppedByACrashKeepsTheOldIndex) {
  CommitOne("checkpoint_000001", 1, "{}");
  std::vector<std::string> warnings;
  auto index = CheckpointIndex::Load(run_, &warnings);
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE(index->Save().ok());
  testing::FaultInjectingFileSystem crashing;
  auto loaded = CheckpointIndex::Load(run_, &warnings, crashing);
  ASSERT_TRUE(loaded.ok());
  loaded->Add(CommitOne("checkpoint_000002", 2, "{}"));
  crashing.CrashAt(crashing.operations());
  EXPECT_EQ(loaded->Save().code(), StatusCode::kUnavailable);
  json saved = json::parse(ReadTestFile(JoinPath(run_, "checkpoints.json")));
  EXPECT_EQ(saved["latest"], "checkpoint_000001");
}

INSTANTIATE_TEST_SUITE_P(NewAndReusedName, CommitCrashTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "ReusedName" : "NewName"; });

}  // namespace
}  // namespace jaxtrain::storage
