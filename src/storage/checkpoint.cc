#include "storage/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>

#include "storage/crc32c.h"
#include "storage/files.h"
#include "storage/metrics.h"

namespace jaxtrain::storage {
namespace {

constexpr size_t kCopyChunk = 4 << 20;
constexpr char kIndexName[] = "checkpoints.json";

Status IoError(std::string_view what, const std::string& path, int err) {
  std::string message = std::string(what) + " '" + path + "': " + std::strerror(err);
  if (err == EACCES || err == EPERM || err == EROFS) return PermissionDeniedError(message);
  if (err == ENOENT) return NotFoundError(message);
  return InternalError(message);
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

Status FsyncPath(const std::string& path, bool directory) {
  Fd f{open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC)};
  if (f.fd < 0) return IoError("cannot open", path, errno);
  if (fsync(f.fd) != 0) return IoError("cannot fsync", path, errno);
  return OkStatus();
}

Status WriteFully(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return IoError("cannot write", path, errno);
    data += w;
    n -= static_cast<size_t>(w);
  }
  return OkStatus();
}

// Copies one file and checksums it. The source is mapped, so the checksum reads the page cache in
// place, and the data moves with copy_file_range inside the kernel where the filesystems allow;
// a file that cannot be mapped is streamed through `buffer`. The source must not be truncated
// while it is copied (report() copies before it returns).
StatusOr<FileEntry> CopyFile(const std::string& src, const std::string& dst, const std::string& rel,
                             std::vector<char>& buffer) {
  Fd in{open(src.c_str(), O_RDONLY | O_CLOEXEC)};
  if (in.fd < 0) return IoError("cannot open", src, errno);
  Fd out{open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (out.fd < 0) return IoError("cannot create", dst, errno);
  struct stat st;
  if (fstat(in.fd, &st) != 0) return IoError("cannot stat", src, errno);
  FileEntry entry{.path = rel};
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = size > 0 ? mmap(nullptr, size, PROT_READ, MAP_PRIVATE, in.fd, 0) : MAP_FAILED;
  if (map != MAP_FAILED) {
    madvise(map, size, MADV_SEQUENTIAL | MADV_WILLNEED);
    const char* data = static_cast<const char*>(map);
    entry.crc32c = Crc32c(0, data, size);
    entry.size = size;
    loff_t in_off = 0, out_off = 0;
    Status copied;
    while (static_cast<size_t>(in_off) < size) {
      ssize_t n =
          copy_file_range(in.fd, &in_off, out.fd, &out_off, size - static_cast<size_t>(in_off), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {  // not supported between these filesystems: write from the mapping
        copied = WriteFully(out.fd, data + in_off, size - static_cast<size_t>(in_off), dst);
        break;
      }
    }
    munmap(map, size);
    JT_RETURN_IF_ERROR(copied);
  } else {
    posix_fadvise(in.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    for (;;) {
      ssize_t n = read(in.fd, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return IoError("cannot read", src, errno);
      if (n == 0) break;
      entry.crc32c = Crc32c(entry.crc32c, buffer.data(), static_cast<size_t>(n));
      entry.size += static_cast<uint64_t>(n);
      JT_RETURN_IF_ERROR(WriteFully(out.fd, buffer.data(), static_cast<size_t>(n), dst));
    }
  }
  if (fsync(out.fd) != 0) return IoError("cannot fsync", dst, errno);
  return entry;
}

Status CopyTree(const std::string& src, const std::string& dst, const std::string& rel,
                std::vector<FileEntry>* entries, std::vector<char>& buffer) {
  JT_RETURN_IF_ERROR(MakeDirs(dst));
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(src.c_str()), closedir);
  if (!dir) return IoError("cannot list", src, errno);
  std::vector<std::string> names;
  while (dirent* e = readdir(dir.get())) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    std::string from = JoinPath(src, name);
    std::string to = JoinPath(dst, name);
    std::string rel_name = rel.empty() ? name : rel + "/" + name;
    struct stat st;
    if (stat(from.c_str(), &st) != 0) return IoError("cannot stat", from, errno);
    if (S_ISDIR(st.st_mode)) {
      JT_RETURN_IF_ERROR(CopyTree(from, to, rel_name, entries, buffer));
    } else if (S_ISREG(st.st_mode)) {
      JT_ASSIGN_OR_RETURN(FileEntry entry, CopyFile(from, to, rel_name, buffer));
      entries->push_back(std::move(entry));
    }
  }
  return FsyncPath(dst, /*directory=*/true);
}

bool ValidDirName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.front() != '.' &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos &&
         name != kIndexName && name != "logs";
}

nlohmann::json RecordToJson(const CheckpointRecord& r) {
  return {{"dir_name", r.dir_name}, {"round", r.round}, {"time", r.time},
          {"metrics", r.metrics},   {"bytes", r.bytes}, {"files", r.files}};
}

// nullopt when `j` is not a record: files written by hand or damaged must not throw.
std::optional<CheckpointRecord> RecordFromJson(const nlohmann::json& j) {
  try {
    CheckpointRecord r;
    r.dir_name = j.value("dir_name", "");
    r.round = j.value("round", uint64_t{0});
    r.time = j.value("time", 0.0);
    r.metrics = j.value("metrics", nlohmann::json::object());
    r.bytes = j.value("bytes", uint64_t{0});
    r.files = j.value("files", uint64_t{0});
    return r;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

struct ManifestFile {
  std::string path;
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

std::optional<std::vector<ManifestFile>> ManifestFiles(const nlohmann::json& manifest) {
  try {
    std::vector<ManifestFile> out;
    for (const auto& f : manifest.at("file_list")) {
      out.push_back({f.at("path").get<std::string>(), f.at("size").get<uint64_t>(),
                     f.at("crc32c").get<uint32_t>()});
    }
    return out;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

// The parent directories of `rel` inside `root`, shallowest first ("a/b/c" -> root/a, root/a/b).
std::vector<std::string> ParentDirs(const std::string& root, const std::string& rel) {
  std::vector<std::string> out;
  for (size_t slash = rel.find('/'); slash != std::string::npos; slash = rel.find('/', slash + 1)) {
    out.push_back(JoinPath(root, rel.substr(0, slash)));
  }
  return out;
}

}  // namespace

StatusOr<std::vector<FileEntry>> StageDirectory(const std::string& src, const std::string& dst) {
  struct stat st;
  if (stat(src.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFoundError("checkpoint directory '" + src + "' does not exist");
    return IoError("cannot read the checkpoint directory", src, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError("checkpoint path '" + src +
                                "' is not a directory; Checkpoint.from_directory() takes the "
                                "directory the checkpoint's files are in");
  }
  std::vector<FileEntry> entries;
  std::vector<char> buffer(kCopyChunk);
  JT_RETURN_IF_ERROR(CopyTree(src, dst, "", &entries, buffer));
  return entries;
}

std::string StagingPath(const std::string& run_dir, int attempt, uint64_t round, int rank) {
  return JoinPath(JoinPath(run_dir, kStagingDir), "a" + std::to_string(attempt) + "-r" +
                                                      std::to_string(round) + "-rank" +
                                                      std::to_string(rank));
}

StatusOr<CheckpointRecord> CommitCheckpoint(const std::string& run_dir, const std::string& dir_name,
                                            uint64_t round, double time,
                                            const std::string& metrics_json,
                                            const std::vector<RankCheckpoint>& ranks) {
  if (!ValidDirName(dir_name)) {
    return InvalidArgumentError("checkpoint_dir_name='" + dir_name +
                                "' is not allowed; it must be one directory name, not starting "
                                "with '.', and not 'logs' or 'checkpoints.json'");
  }
  std::map<std::string, int> owner;
  CheckpointRecord record{.dir_name = dir_name, .round = round, .time = time};
  for (const auto& rc : ranks) {
    for (const auto& f : rc.files) {
      if (f.path == kManifestName) {
        return InvalidArgumentError("rank " + std::to_string(rc.rank) +
                                    "'s checkpoint has a file '" + std::string(kManifestName) +
                                    "', a name jaxtrain reserves for the manifest; rename it");
      }
      auto [it, inserted] = owner.emplace(f.path, rc.rank);
      if (!inserted) {
        return InvalidArgumentError(
            "rank " + std::to_string(it->second) + " and rank " + std::to_string(rc.rank) +
            " both wrote '" + f.path + "' to the checkpoint of round " + std::to_string(round) +
            "; ranks must write different files into a checkpoint (e.g. name them by rank)");
      }
      record.bytes += f.size;
      ++record.files;
    }
  }
  nlohmann::json metrics = ParseMetricsJson(metrics_json);
  record.metrics = metrics.is_object() ? metrics : nlohmann::json::object();

  const std::string staging = JoinPath(run_dir, kStagingDir);
  const std::string tmp = JoinPath(staging, "commit-r" + std::to_string(round) + "-" + dir_name);
  JT_RETURN_IF_ERROR(RemoveTree(tmp));
  JT_RETURN_IF_ERROR(MakeDirs(tmp));
  std::vector<std::string> dirs = {tmp};
  nlohmann::json files = nlohmann::json::array();
  for (const auto& rc : ranks) {
    for (const auto& f : rc.files) {
      for (const auto& parent : ParentDirs(tmp, f.path)) {
        if (mkdir(parent.c_str(), 0755) == 0) {
          dirs.push_back(parent);
        } else if (errno != EEXIST) {
          return IoError("cannot create directory", parent, errno);
        }
      }
      std::string from = JoinPath(rc.staging_dir, f.path);
      std::string to = JoinPath(tmp, f.path);
      if (rename(from.c_str(), to.c_str()) != 0) return IoError("cannot move", from, errno);
      files.push_back(
          {{"path", f.path}, {"size", f.size}, {"crc32c", f.crc32c}, {"rank", rc.rank}});
    }
  }
  nlohmann::json manifest = RecordToJson(record);
  manifest["version"] = 1;
  manifest["file_list"] = files;
  JT_RETURN_IF_ERROR(WriteFileAtomically(JoinPath(tmp, kManifestName), manifest.dump(1) + "\n"));
  // The renames above changed directory entries: make them durable before the commit point.
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    JT_RETURN_IF_ERROR(FsyncPath(*it, /*directory=*/true));
  }

  const std::string final_dir = JoinPath(run_dir, dir_name);
  struct stat st;
  if (lstat(final_dir.c_str(), &st) == 0) {
    // The commit point for a reused name: swap the new directory in, then drop the old one.
    if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
      return IoError("cannot replace the checkpoint", final_dir, errno);
    }
    JT_RETURN_IF_ERROR(RemoveTree(tmp));
  } else if (rename(tmp.c_str(), final_dir.c_str()) != 0) {  // the commit point
    return IoError("cannot commit the checkpoint", final_dir, errno);
  }
  JT_RETURN_IF_ERROR(FsyncPath(run_dir, /*directory=*/true));
  for (const auto& rc : ranks) JT_RETURN_IF_ERROR(RemoveTree(rc.staging_dir));
  return record;
}

StatusOr<CheckpointRecord> ReadCheckpointRecord(const std::string& dir) {
  auto text = ReadFile(JoinPath(dir, kManifestName));
  if (!text.ok()) {
    return NotFoundError("'" + dir + "' is not a committed checkpoint: it has no manifest");
  }
  auto manifest = nlohmann::json::parse(*text, nullptr, false);
  auto record = RecordFromJson(manifest);
  if (!record) return DataLossError("the manifest of checkpoint '" + dir + "' is damaged");
  return *record;
}

Status VerifyCheckpoint(const std::string& dir, bool checksums) {
  auto text = ReadFile(JoinPath(dir, kManifestName));
  if (!text.ok()) {
    return NotFoundError("'" + dir + "' is not a committed checkpoint: it has no manifest");
  }
  auto files = ManifestFiles(nlohmann::json::parse(*text, nullptr, false));
  if (!files) return DataLossError("the manifest of checkpoint '" + dir + "' is damaged");
  std::vector<char> buffer(kCopyChunk);
  for (const auto& f : *files) {
    std::string path = JoinPath(dir, f.path);
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return DataLossError("checkpoint file '" + path + "' is missing");
    }
    if (static_cast<uint64_t>(st.st_size) != f.size) {
      return DataLossError("checkpoint file '" + path + "' has " + std::to_string(st.st_size) +
                           " bytes; its manifest says " + std::to_string(f.size));
    }
    if (!checksums) continue;
    Fd in{open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (in.fd < 0) return IoError("cannot open", path, errno);
    uint32_t crc = 0;
    for (;;) {
      ssize_t n = read(in.fd, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return IoError("cannot read", path, errno);
      if (n == 0) break;
      crc = Crc32c(crc, buffer.data(), static_cast<size_t>(n));
    }
    if (crc != f.crc32c) {
      return DataLossError("checkpoint file '" + path +
                           "' does not match its checksum: it changed after it was committed");
    }
  }
  return OkStatus();
}

StatusOr<CheckpointIndex> CheckpointIndex::Load(const std::string& run_dir,
                                                std::vector<std::string>* warnings) {
  CheckpointIndex index;
  index.run_dir_ = run_dir;
  const std::string index_path = JoinPath(run_dir, kIndexName);
  auto text = ReadFile(index_path);
  if (!text.ok() && text.status().code() != StatusCode::kNotFound) {
    return DataLossError("cannot read '" + index_path + "': " + text.status().message());
  }
  if (text.ok()) {
    auto j = nlohmann::json::parse(*text, nullptr, false);
    std::vector<CheckpointRecord> listed;
    bool damaged = !j.is_object() || !j.contains("checkpoints") || !j["checkpoints"].is_array();
    for (const auto& entry : damaged ? nlohmann::json::array() : j["checkpoints"]) {
      auto r = RecordFromJson(entry);
      if (!r) damaged = true;
      if (r) listed.push_back(std::move(*r));
    }
    if (damaged) return DataLossError("'" + index_path + "' is damaged");
    for (auto& r : listed) {
      if (ReadCheckpointRecord(JoinPath(run_dir, r.dir_name)).ok()) {
        index.records_.push_back(std::move(r));
      } else {
        warnings->push_back("checkpoint '" + r.dir_name +
                            "' is in the index but no longer in the run directory; forgetting it");
      }
    }
  }
  // A commit that renamed its directory into place but crashed before updating the index.
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(run_dir.c_str()), closedir);
  std::vector<CheckpointRecord> found;
  for (dirent* e = dir ? readdir(dir.get()) : nullptr; e; e = readdir(dir.get())) {
    std::string name = e->d_name;
    if (!ValidDirName(name)) continue;
    bool known = std::any_of(index.records_.begin(), index.records_.end(),
                             [&](const CheckpointRecord& r) { return r.dir_name == name; });
    if (known) continue;
    auto record = ReadCheckpointRecord(JoinPath(run_dir, name));
    if (record.ok()) {
      record->dir_name = name;
      warnings->push_back("checkpoint '" + name +
                          "' was committed but missing from the index; "
                          "adding it");
      found.push_back(*record);
    }
  }
  for (auto& r : found) index.records_.push_back(std::move(r));
  // Rounds only grow, so round order is commit order, wherever a record came from.
  std::stable_sort(index.records_.begin(), index.records_.end(),
                   [](const auto& a, const auto& b) { return a.round < b.round; });
  return index;
}

void CheckpointIndex::Add(CheckpointRecord record) {
  Remove(record.dir_name);
  records_.push_back(std::move(record));
}

void CheckpointIndex::Remove(const std::string& dir_name) {
  records_.erase(std::remove_if(records_.begin(), records_.end(),
                                [&](const CheckpointRecord& r) { return r.dir_name == dir_name; }),
                 records_.end());
}

Status CheckpointIndex::Save() const {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& r : records_) list.push_back(RecordToJson(r));
  nlohmann::json j = {
      {"version", 1},
      {"checkpoints", list},
      {"latest", records_.empty() ? nlohmann::json() : nlohmann::json(records_.back().dir_name)}};
  return WriteFileAtomically(JoinPath(run_dir_, kIndexName), j.dump(1) + "\n");
}

std::vector<CheckpointRecord> RankByScore(std::vector<CheckpointRecord> records,
                                          const RetentionPolicy& policy) {
  // Newest first; a stable sort by score keeps the newer of equal scores ahead.
  std::reverse(records.begin(), records.end());
  if (!policy.score_attribute) return records;
  auto score = [&](const CheckpointRecord& r) -> std::optional<double> {
    auto v = MetricValue(r.metrics, *policy.score_attribute);
    if (v && std::isnan(*v)) return std::nullopt;
    return v;
  };
  std::stable_sort(records.begin(), records.end(), [&](const auto& a, const auto& b) {
    auto sa = score(a), sb = score(b);
    if (!sa || !sb) return sa.has_value() && !sb.has_value();
    return policy.higher_is_better ? *sa > *sb : *sa < *sb;
  });
  return records;
}

std::vector<std::string> SelectForDeletion(const std::vector<CheckpointRecord>& records,
                                           const RetentionPolicy& policy) {
  if (!policy.num_to_keep || records.empty()) return {};
  const std::string& latest = records.back().dir_name;
  std::vector<CheckpointRecord> ranked = RankByScore(records, policy);
  std::vector<std::string> doomed;
  for (size_t i = static_cast<size_t>(*policy.num_to_keep); i < ranked.size(); ++i) {
    if (ranked[i].dir_name != latest) doomed.push_back(ranked[i].dir_name);
  }
  return doomed;
}

Status RemoveTree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return OkStatus();
  int rc = nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, FTW*) { return remove(p) == 0 ? 0 : errno; }, 32,
      FTW_DEPTH | FTW_PHYS);
  if (rc != 0) return IoError("cannot remove", path, rc > 0 ? rc : errno);
  return OkStatus();
}

}  // namespace jaxtrain::storage
