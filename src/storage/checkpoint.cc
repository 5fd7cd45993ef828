#include "storage/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "base/mutex.h"
#include "storage/crc32c.h"
#include "storage/files.h"
#include "storage/metrics.h"
#include "storage/sha256.h"

namespace jaxtrain::storage {
namespace {

constexpr size_t kCopyChunk = 4 << 20;
constexpr char kIndexName[] = "checkpoints.json";

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

// A file's checksums, taken in one pass over its bytes: the CRC-32C always, the SHA-256 when
// asked for (StageDirectory's, WriteSnapshot's and DescribeSnapshot's `hash`).
class Checksums {
 public:
  explicit Checksums(bool sha256) {
    if (sha256) sha256_.emplace();
  }

  void Update(const char* data, size_t size) {
    // In pieces that stay in the cache between the two sums.
    constexpr size_t kPiece = 1 << 20;
    for (size_t done = 0; done < size;) {
      const size_t n = std::min(kPiece, size - done);
      crc32c_ = Crc32c(crc32c_, data + done, n);
      if (sha256_) sha256_->Update(data + done, n);
      done += n;
    }
  }

  uint32_t crc32c() const { return crc32c_; }

  // The SHA-256 in hex; "" when it was not asked for. Ends the sum.
  std::string Sha256Hex() { return sha256_ ? sha256_->HexDigest() : ""; }

 private:
  uint32_t crc32c_ = 0;
  std::optional<Sha256> sha256_;
};

Status FsyncPath(const std::string& path, bool directory) {
  Fd f{open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC)};
  if (f.fd < 0) return PathError("cannot open", path, errno);
  if (fsync(f.fd) != 0) return PathError("cannot fsync", path, errno);
  return OkStatus();
}

// Copies one file and checksums it. The source is mapped, so the checksum reads the page cache in
// place, and the data moves with copy_file_range inside the kernel where the filesystems allow;
// a file that cannot be mapped is streamed through `buffer`. The source must not be truncated
// while it is copied (report() copies before it returns).
// The copy gets the source's permission bits (the umask applies, so never wider than it allows)
// plus read for the owner, who verifies and uploads it; a link swapped in for the source after it
// was listed is not followed (O_NOFOLLOW). With `durable` the copy is fsynced; with `hash` its
// SHA-256 is taken with the CRC-32C.
StatusOr<FileEntry> CopyFile(const std::string& src, const std::string& dst, const std::string& rel,
                             std::vector<char>& buffer, bool durable, bool hash) {
  Fd in{open(src.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (in.fd < 0) return PathError("cannot open", src, errno);
  struct stat st;
  if (fstat(in.fd, &st) != 0) return PathError("cannot stat", src, errno);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgumentError("checkpoint file '" + src + "' changed while it was copied");
  }
  const mode_t mode = (st.st_mode & 0777) | 0400;
  // A file already there (a copy into a directory that has one) is replaced, not reused with its
  // own mode, and a link there is not written through.
  if (unlink(dst.c_str()) != 0 && errno != ENOENT) return PathError("cannot replace", dst, errno);
  Fd out{open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode)};
  if (out.fd < 0) return PathError("cannot create", dst, errno);
  struct stat written;
  if (fstat(out.fd, &written) != 0) return PathError("cannot stat", dst, errno);
  FileEntry entry{.path = rel, .mode = static_cast<uint32_t>(written.st_mode & 0777)};
  const size_t size = static_cast<size_t>(st.st_size);
  Checksums sums(hash);
  void* map = size > 0 ? mmap(nullptr, size, PROT_READ, MAP_PRIVATE, in.fd, 0) : MAP_FAILED;
  if (map != MAP_FAILED) {
    madvise(map, size, MADV_SEQUENTIAL | MADV_WILLNEED);
    const char* data = static_cast<const char*>(map);
    sums.Update(data, size);
    entry.size = size;
    loff_t in_off = 0, out_off = 0;
    Status copied;
    while (static_cast<size_t>(in_off) < size) {
      ssize_t n =
          copy_file_range(in.fd, &in_off, out.fd, &out_off, size - static_cast<size_t>(in_off), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {  // not supported between these filesystems: write from the mapping
        copied = WriteFd(out.fd,
                         std::string_view(data + in_off, size - static_cast<size_t>(in_off)), dst);
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
      if (n < 0) return PathError("cannot read", src, errno);
      if (n == 0) break;
      sums.Update(buffer.data(), static_cast<size_t>(n));
      entry.size += static_cast<uint64_t>(n);
      JT_RETURN_IF_ERROR(
          WriteFd(out.fd, std::string_view(buffer.data(), static_cast<size_t>(n)), dst));
    }
  }
  if (durable && fsync(out.fd) != 0) return PathError("cannot fsync", dst, errno);
  entry.crc32c = sums.crc32c();
  entry.sha256 = sums.Sha256Hex();
  return entry;
}

// The components of a relative path; "" and "." dropped, ".." kept.
std::vector<std::string> Components(std::string_view path) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string part(path.substr(start, end - start));
    if (!part.empty() && part != ".") out.push_back(std::move(part));
    start = end + 1;
  }
  return out;
}

// Where `target`, the target of a link at `link_rel` inside a checkpoint, lands, relative to the
// checkpoint's root, by the names alone; nullopt when it is absolute or climbs out.
std::optional<std::string> LexicalTarget(const std::string& link_rel, const std::string& target) {
  if (target.empty() || target.front() == '/') return std::nullopt;
  std::vector<std::string> at = Components(link_rel);
  if (!at.empty()) at.pop_back();  // the link's own name
  for (auto& part : Components(target)) {
    if (part != "..") {
      at.push_back(std::move(part));
    } else if (at.empty()) {
      return std::nullopt;
    } else {
      at.pop_back();
    }
  }
  std::string out;
  for (const auto& part : at) out += (out.empty() ? "" : "/") + part;
  return out;
}

// A target for a link at `link_rel` that reaches `inside` (relative to the root) from the link's
// own directory: "../" once per level, then the path.
std::string RelativeTarget(const std::string& link_rel, const std::string& inside) {
  std::string out;
  for (size_t i = 1; i < Components(link_rel).size(); ++i) out += "../";
  out += inside.empty() ? "." : inside;
  return out;
}

bool IsUnder(const std::string& path, const std::string& root) {
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
}

// Decides a link found at `from` (`rel` in the checkpoint whose real path is `root_real`): the
// target to keep, or kInvalidArgument when it leads out of the checkpoint. The kernel's answer
// (realpath) decides for a target that exists; a dangling one is kept only when its name stays
// inside.
StatusOr<std::string> KeptLinkTarget(const std::string& src_root, const std::string& root_real,
                                     const std::string& from, const std::string& rel) {
  std::vector<char> buf(PATH_MAX + 1);
  ssize_t n = readlink(from.c_str(), buf.data(), buf.size() - 1);
  if (n < 0) return PathError("cannot read the link", from, errno);
  const std::string target(buf.data(), static_cast<size_t>(n));
  auto refuse = [&](const std::string& why) {
    return InvalidArgumentError(
        "checkpoint directory '" + src_root + "' holds a symbolic link '" + rel + "' -> '" +
        target + "' " + why +
        "; jaxtrain never follows a link out of a checkpoint: copy the file into the directory, or "
        "point the link at a file inside it");
  };
  std::optional<std::string> lexical = LexicalTarget(rel, target);
  char* real = realpath(from.c_str(), nullptr);
  if (real == nullptr) {
    if (errno == ENOENT && lexical) return target;  // dangling, but inside by name
    return refuse(errno == ENOENT
                      ? "whose target does not exist and is not inside it"
                      : std::string("that cannot be resolved: ") + std::strerror(errno));
  }
  const std::string resolved(real);
  free(real);
  if (!IsUnder(resolved, root_real))
    return refuse("that points outside it (to '" + resolved + "')");
  if (lexical) return target;
  // Absolute, or climbing out and back in by the directory's own name: keep it relative.
  return RelativeTarget(rel, resolved == root_real ? "" : resolved.substr(root_real.size() + 1));
}

// One entry of a checkpoint directory being staged, listed before anything is copied: a
// directory, a regular file (with its size when listed) or a kept link (with its target).
struct TreeItem {
  enum class Kind { kDir, kFile, kLink };
  Kind kind = Kind::kFile;
  std::string rel;   // relative to the checkpoint's root
  std::string from;  // the source path
  mode_t mode = 0;   // the source's st_mode
  uint64_t size = 0;
  std::string link;  // kLink: the target to keep
};

// Lists the tree under `src` (part of the checkpoint `src_root`, real path `root_real`), sorted by
// name, a directory before its contents; links decided by KeptLinkTarget, other kinds skipped.
Status ListTree(const std::string& src_root, const std::string& root_real, const std::string& src,
                const std::string& rel, std::vector<TreeItem>* items) {
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(src.c_str()), closedir);
  if (!dir) return PathError("cannot list", src, errno);
  std::vector<std::string> names;
  while (dirent* e = readdir(dir.get())) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    TreeItem item{.rel = rel.empty() ? name : rel + "/" + name, .from = JoinPath(src, name)};
    struct stat st;
    if (lstat(item.from.c_str(), &st) != 0) return PathError("cannot stat", item.from, errno);
    item.mode = st.st_mode;
    if (S_ISLNK(st.st_mode)) {
      item.kind = TreeItem::Kind::kLink;
      JT_ASSIGN_OR_RETURN(item.link, KeptLinkTarget(src_root, root_real, item.from, item.rel));
      items->push_back(std::move(item));
    } else if (S_ISDIR(st.st_mode)) {
      item.kind = TreeItem::Kind::kDir;
      const std::string from = item.from, sub = item.rel;
      items->push_back(std::move(item));
      JT_RETURN_IF_ERROR(ListTree(src_root, root_real, from, sub, items));
    } else if (S_ISREG(st.st_mode)) {
      item.size = static_cast<uint64_t>(st.st_size);
      items->push_back(std::move(item));
    }
  }
  return OkStatus();
}

// The checkpoint directory `src` as a list (ListTree), after checking that it is a directory.
StatusOr<std::vector<TreeItem>> ListCheckpointDirectory(const std::string& src) {
  struct stat st;
  if (stat(src.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFoundError("checkpoint directory '" + src + "' does not exist");
    return PathError("cannot read the checkpoint directory", src, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError("checkpoint path '" + src +
                                "' is not a directory; Checkpoint.from_directory() takes the "
                                "directory the checkpoint's files are in");
  }
  char* real = realpath(src.c_str(), nullptr);
  if (real == nullptr) return PathError("cannot resolve the checkpoint directory", src, errno);
  const std::string root_real(real);
  free(real);
  std::vector<TreeItem> items;
  JT_RETURN_IF_ERROR(ListTree(src, root_real, src, "", &items));
  return items;
}

// Creates the directory or link `item` at `to` (a file already there is replaced, a directory
// there is kept); a link is added to `entries`.
Status PlaceDirOrLink(const TreeItem& item, const std::string& to,
                      std::vector<FileEntry>* entries) {
  if (item.kind == TreeItem::Kind::kLink) {
    if (unlink(to.c_str()) != 0 && errno != ENOENT) return PathError("cannot replace", to, errno);
    if (symlink(item.link.c_str(), to.c_str()) != 0) return PathError("cannot create", to, errno);
    entries->push_back({.path = item.rel, .mode = 0777, .link = item.link});
    return OkStatus();
  }
  // The owner keeps rwx: files go in now, and retention deletes the directory later.
  struct stat there;
  if (mkdir(to.c_str(), (item.mode & 0777) | 0700) != 0 &&
      (errno != EEXIST || lstat(to.c_str(), &there) != 0 || !S_ISDIR(there.st_mode))) {
    return PathError("cannot create directory", to, errno);
  }
  return OkStatus();
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

nlohmann::json EntryToJson(const FileEntry& f, int rank) {
  if (!f.link.empty()) return {{"path", f.path}, {"target", f.link}, {"rank", rank}};
  nlohmann::json j = {
      {"path", f.path}, {"size", f.size}, {"crc32c", f.crc32c}, {"mode", f.mode}, {"rank", rank}};
  if (!f.sha256.empty()) j["sha256"] = f.sha256;
  return j;
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

StatusOr<std::vector<FileEntry>> StageDirectory(const std::string& src, const std::string& dst,
                                                bool durable, bool hash) {
  JT_ASSIGN_OR_RETURN(std::vector<TreeItem> items, ListCheckpointDirectory(src));
  std::vector<FileEntry> entries;
  std::vector<char> buffer(kCopyChunk);
  std::vector<std::string> dirs = {dst};
  JT_RETURN_IF_ERROR(MakeDirs(dst));
  for (const TreeItem& item : items) {
    const std::string to = JoinPath(dst, item.rel);
    if (item.kind == TreeItem::Kind::kFile) {
      JT_ASSIGN_OR_RETURN(FileEntry entry,
                          CopyFile(item.from, to, item.rel, buffer, durable, hash));
      entries.push_back(std::move(entry));
      continue;
    }
    JT_RETURN_IF_ERROR(PlaceDirOrLink(item, to, &entries));
    if (item.kind == TreeItem::Kind::kDir) dirs.push_back(to);
  }
  if (durable) {
    for (const auto& dir : dirs) JT_RETURN_IF_ERROR(FsyncPath(dir, /*directory=*/true));
  }
  return entries;
}

namespace {

// Buffers of destroyed snapshots, by size, kept for the next snapshot (SnapshotRelease).
struct KeptBuffers {
  Mutex mu;
  std::multimap<size_t, char*> free GUARDED_BY(mu);  // mapping size -> mapping
  uint64_t bytes GUARDED_BY(mu) = 0;
};

KeptBuffers& Kept() {
  static auto* kept = new KeptBuffers;  // never destroyed: released from any thread until exit
  return *kept;
}

// The smallest kept buffer of at least `size` bytes, or a new mapping; null when none can be had.
std::unique_ptr<char, SnapshotRelease> TakeBuffer(size_t size) {
  const size_t mapped = std::max<size_t>(size, 1);
  {
    KeptBuffers& kept = Kept();
    MutexLock lock(kept.mu);
    auto it = kept.free.lower_bound(mapped);
    if (it != kept.free.end()) {
      std::unique_ptr<char, SnapshotRelease> buffer(it->second, {.bytes = it->first});
      kept.bytes -= it->first;
      kept.free.erase(it);
      return buffer;
    }
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Huge pages where the kernel has them: a few faults per file instead of one per 4 KiB page.
  madvise(p, mapped, MADV_HUGEPAGE);
  return std::unique_ptr<char, SnapshotRelease>(static_cast<char*>(p), {.bytes = mapped});
}

// Unmaps the kept buffers: a snapshot has taken what it could reuse of them.
void DropKeptBuffers() {
  std::multimap<size_t, char*> dropped;
  {
    KeptBuffers& kept = Kept();
    MutexLock lock(kept.mu);
    dropped.swap(kept.free);
    kept.bytes = 0;
  }
  for (const auto& [size, p] : dropped) munmap(p, size);
}

}  // namespace

void SnapshotRelease::operator()(char* p) const {
  KeptBuffers& kept = Kept();
  MutexLock lock(kept.mu);
  kept.free.emplace(bytes, p);
  kept.bytes += bytes;
}

uint64_t KeptSnapshotBytes() {
  KeptBuffers& kept = Kept();
  MutexLock lock(kept.mu);
  return kept.bytes;
}

namespace {

// Writes `data` into the file `fd` (`path`) through the page cache, starting the disk's
// writeback of each chunk as soon as it is written (sync_file_range), so that most of it is on
// disk by the time the commit fsyncs the file.
Status WriteAndStartWriteback(int fd, std::string_view data, const std::string& path) {
  constexpr size_t kChunk = 16 << 20;
  for (size_t done = 0; done < data.size();) {
    const size_t n = std::min(kChunk, data.size() - done);
    JT_RETURN_IF_ERROR(WriteFd(fd, data.substr(done, n), path));
    // A hint: where it fails, the commit's fsync writes everything.
    sync_file_range(fd, static_cast<off_t>(done), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
    done += n;
  }
  return OkStatus();
}

}  // namespace

StatusOr<DirectorySnapshot> SnapshotDirectory(const std::string& src, uint64_t budget_bytes) {
  JT_ASSIGN_OR_RETURN(std::vector<TreeItem> items, ListCheckpointDirectory(src));
  uint64_t listed = 0;
  for (const TreeItem& item : items) listed += item.size;
  auto over_budget = [&](uint64_t bytes) {
    return ResourceExhaustedError("checkpoint directory '" + src + "' holds " +
                                  std::to_string(bytes) +
                                  " bytes, more than the snapshot budget "
                                  "of " +
                                  std::to_string(budget_bytes) + " bytes");
  };
  if (listed > budget_bytes) return over_budget(listed);
  DirectorySnapshot snapshot;
  // Whatever this snapshot does not reuse of the kept buffers is unmapped when it ends.
  struct DropUnused {
    ~DropUnused() { DropKeptBuffers(); }
  } drop_unused;
  for (TreeItem& item : items) {
    DirectorySnapshot::Item out;
    out.rel = std::move(item.rel);
    out.mode = static_cast<uint32_t>(item.mode & 0777);
    out.link = std::move(item.link);
    if (item.kind != TreeItem::Kind::kFile) {
      out.kind = item.kind == TreeItem::Kind::kDir ? DirectorySnapshot::Kind::kDir
                                                   : DirectorySnapshot::Kind::kLink;
      snapshot.items.push_back(std::move(out));
      continue;
    }
    Fd in{open(item.from.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
    if (in.fd < 0) return PathError("cannot open", item.from, errno);
    struct stat st;
    if (fstat(in.fd, &st) != 0) return PathError("cannot stat", item.from, errno);
    if (!S_ISREG(st.st_mode)) {
      return InvalidArgumentError("checkpoint file '" + item.from + "' changed while it was read");
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (snapshot.bytes + size > budget_bytes) return over_budget(snapshot.bytes + size);
    out.mode = static_cast<uint32_t>(st.st_mode & 0777);
    out.data = TakeBuffer(size);
    if (out.data == nullptr) return over_budget(snapshot.bytes + size);
    posix_fadvise(in.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    while (out.size < size) {  // a file cut short while it is read ends where it ends
      ssize_t n = read(in.fd, out.data.get() + out.size, size - out.size);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return PathError("cannot read", item.from, errno);
      if (n == 0) break;
      out.size += static_cast<uint64_t>(n);
    }
    snapshot.bytes += out.size;
    snapshot.items.push_back(std::move(out));
  }
  return snapshot;
}

namespace {

// A snapshot file's manifest entry with `mode`: its CRC-32C, and with `hash` its SHA-256,
// computed once per item (a later write or description of the same snapshot reuses it).
FileEntry SnapshotFileEntry(const DirectorySnapshot::Item& item, uint32_t mode, bool hash) {
  Checksums sums(hash && item.sha256.empty());
  sums.Update(item.data.get(), item.size);
  if (hash && item.sha256.empty()) item.sha256 = sums.Sha256Hex();
  return {.path = item.rel,
          .size = item.size,
          .crc32c = sums.crc32c(),
          .mode = mode,
          .sha256 = hash ? item.sha256 : ""};
}

}  // namespace

StatusOr<std::vector<FileEntry>> WriteSnapshot(const DirectorySnapshot& snapshot,
                                               const std::string& dst, bool hash) {
  std::vector<FileEntry> entries;
  JT_RETURN_IF_ERROR(MakeDirs(dst));
  for (const DirectorySnapshot::Item& item : snapshot.items) {
    const std::string to = JoinPath(dst, item.rel);
    if (item.kind != DirectorySnapshot::Kind::kFile) {
      TreeItem placed{.kind = item.kind == DirectorySnapshot::Kind::kDir ? TreeItem::Kind::kDir
                                                                         : TreeItem::Kind::kLink,
                      .rel = item.rel,
                      .mode = item.mode,
                      .link = item.link};
      JT_RETURN_IF_ERROR(PlaceDirOrLink(placed, to, &entries));
      continue;
    }
    if (unlink(to.c_str()) != 0 && errno != ENOENT) return PathError("cannot replace", to, errno);
    Fd out{open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                static_cast<mode_t>(item.mode | 0400))};
    if (out.fd < 0) return PathError("cannot create", to, errno);
    struct stat written;
    if (fstat(out.fd, &written) != 0) return PathError("cannot stat", to, errno);
    JT_RETURN_IF_ERROR(
        WriteAndStartWriteback(out.fd, std::string_view(item.data.get(), item.size), to));
    entries.push_back(SnapshotFileEntry(item, static_cast<uint32_t>(written.st_mode & 0777), hash));
  }
  return entries;
}

std::vector<FileEntry> DescribeSnapshot(const DirectorySnapshot& snapshot, bool hash) {
  std::vector<FileEntry> entries;
  for (const DirectorySnapshot::Item& item : snapshot.items) {
    if (item.kind == DirectorySnapshot::Kind::kLink) {
      entries.push_back({.path = item.rel, .mode = 0777, .link = item.link});
      continue;
    }
    if (item.kind != DirectorySnapshot::Kind::kFile) continue;
    entries.push_back(SnapshotFileEntry(item, item.mode | 0400, hash));
  }
  return entries;
}

bool IsSha256HexOrEmpty(const std::string& hex) {
  return hex.empty() ||
         (hex.size() == kSha256HexSize && std::all_of(hex.begin(), hex.end(), [](char c) {
            return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
          }));
}

bool IsCleanRelativePath(const std::string& path) {
  if (path.empty() || path.front() == '/' || path.find('\0') != std::string::npos) return false;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string_view part(path.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

// What every entry of a part must be, wherever its files are: a clean relative path, and a
// sha256 that is "" or one.
Status CheckEntryForm(const std::string& who, const FileEntry& f) {
  if (!IsCleanRelativePath(f.path)) {
    return InvalidArgumentError(who + " names the file '" + f.path +
                                "', which is not a clean relative path (no leading '/', no "
                                "'..', '.' or empty parts); refused");
  }
  if (!IsSha256HexOrEmpty(f.sha256)) {
    return InvalidArgumentError(who + " gives '" + f.path + "' the sha256 '" + f.sha256 +
                                "', which is not 64 lowercase hexadecimal digits; refused");
  }
  return OkStatus();
}

// CheckStagedPart of a part whose files are in the store: only what its description says.
Status CheckStoredPart(const RankCheckpoint& part) {
  const std::string who = "rank " + std::to_string(part.rank) + "'s checkpoint";
  if (!part.staging_dir.empty()) {
    return InvalidArgumentError(who + " is in the store, yet names the staging directory '" +
                                part.staging_dir + "'; refused");
  }
  for (const auto& f : part.files) {
    JT_RETURN_IF_ERROR(CheckEntryForm(who, f));
    if (!f.link.empty() && !LexicalTarget(f.path, f.link)) {
      return InvalidArgumentError(who + " lists '" + f.path + "' as a link to '" + f.link +
                                  "', which is not a link inside the checkpoint; refused");
    }
  }
  return OkStatus();
}

Status CheckStagedPart(const std::string& run_dir, const RankCheckpoint& part) {
  if (part.in_store) return CheckStoredPart(part);
  const std::string who = "rank " + std::to_string(part.rank) + "'s checkpoint";
  const std::string staging_root = JoinPath(run_dir, kStagingDir) + "/";
  const std::string name = part.staging_dir.compare(0, staging_root.size(), staging_root) == 0
                               ? part.staging_dir.substr(staging_root.size())
                               : "";
  if (name.empty() || !IsCleanRelativePath(name) || name.find('/') != std::string::npos) {
    return InvalidArgumentError(who + " names the staging directory '" + part.staging_dir +
                                "', which is not a directory directly under '" + staging_root +
                                "'; refused: nothing was moved or deleted");
  }
  struct stat st;
  if (lstat(part.staging_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(who + "'s staging directory '" + part.staging_dir +
                                "' is not a directory (a symbolic link, or missing); refused");
  }
  for (const auto& f : part.files) {
    JT_RETURN_IF_ERROR(CheckEntryForm(who, f));
    for (const auto& parent : ParentDirs(part.staging_dir, f.path)) {
      if (lstat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        return InvalidArgumentError(who + " has '" + f.path + "', but '" + parent +
                                    "' is not a directory (a symbolic link, or missing); refused");
      }
    }
    const std::string path = JoinPath(part.staging_dir, f.path);
    if (lstat(path.c_str(), &st) != 0) {
      return InvalidArgumentError(who + " lists '" + f.path + "', which is not in '" +
                                  part.staging_dir + "'");
    }
    if (f.link.empty() && !S_ISREG(st.st_mode)) {
      return InvalidArgumentError(who + " lists '" + f.path +
                                  "' as a file, but it is not a regular file; refused");
    }
    if (!f.link.empty()) {
      std::vector<char> buf(PATH_MAX + 1);
      ssize_t n = S_ISLNK(st.st_mode) ? readlink(path.c_str(), buf.data(), buf.size() - 1) : -1;
      if (n < 0 || std::string(buf.data(), static_cast<size_t>(n)) != f.link ||
          !LexicalTarget(f.path, f.link)) {
        return InvalidArgumentError(who + " lists '" + f.path + "' as a link to '" + f.link +
                                    "', which is not a link inside the checkpoint; refused");
      }
    }
  }
  return OkStatus();
}

std::string StagingPath(const std::string& run_dir, int attempt, uint64_t round, int rank) {
  return JoinPath(JoinPath(run_dir, kStagingDir), "a" + std::to_string(attempt) + "-r" +
                                                      std::to_string(round) + "-rank" +
                                                      std::to_string(rank));
}

StatusOr<CheckpointRecord> CommitCheckpoint(const std::string& run_dir, const std::string& dir_name,
                                            uint64_t round, double time,
                                            const std::string& metrics_json,
                                            const std::vector<RankCheckpoint>& ranks,
                                            FileSystem& fs) {
  if (!ValidDirName(dir_name)) {
    return InvalidArgumentError("checkpoint_dir_name='" + dir_name +
                                "' is not allowed; it must be one directory name, not starting "
                                "with '.', and not 'logs' or 'checkpoints.json'");
  }
  std::map<std::string, int> owner;
  CheckpointRecord record{.dir_name = dir_name, .round = round, .time = time};
  const bool in_store = !ranks.empty() && ranks.front().in_store;
  for (const auto& rc : ranks) {
    if (rc.in_store != in_store) {
      return InvalidArgumentError("rank " + std::to_string(rc.rank) +
                                  "'s part of the checkpoint of round " + std::to_string(round) +
                                  (rc.in_store ? " is in the store" : " is staged here") +
                                  ", rank " + std::to_string(ranks.front().rank) + "'s " +
                                  (in_store ? "in the store" : "staged here") +
                                  "; the ranks of a run write their checkpoints to the same place");
    }
    JT_RETURN_IF_ERROR(CheckStagedPart(run_dir, rc));
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
  JT_RETURN_IF_ERROR(fs.RemoveTree(tmp));
  JT_RETURN_IF_ERROR(fs.MakeDirs(tmp));
  std::vector<std::string> dirs = {tmp};
  nlohmann::json files = nlohmann::json::array();
  nlohmann::json links = nlohmann::json::array();
  nlohmann::json dir_modes = nlohmann::json::array();
  for (const auto& rc : ranks) {
    for (const auto& f : rc.files) {
      if (rc.in_store) {  // uploaded by the rank's host already: the manifest names it
        (f.link.empty() ? files : links).push_back(EntryToJson(f, rc.rank));
        continue;
      }
      const std::vector<std::string> staged_parents = ParentDirs(rc.staging_dir, f.path);
      const std::vector<std::string> parents = ParentDirs(tmp, f.path);
      for (size_t i = 0; i < parents.size(); ++i) {
        // The directory's mode as staged (the first rank to have it decides).
        StatusOr<FileInfo> staged = fs.Stat(staged_parents[i]);
        uint32_t mode = staged.ok() ? staged->mode | 0700 : 0755;
        JT_ASSIGN_OR_RETURN(bool created, fs.MakeDir(parents[i], mode));
        if (created) {
          dirs.push_back(parents[i]);
          StatusOr<FileInfo> made = fs.Stat(parents[i]);
          if (made.ok()) mode = made->mode;  // after the umask
          dir_modes.push_back({{"path", parents[i].substr(tmp.size() + 1)}, {"mode", mode}});
        }
      }
      std::string from = JoinPath(rc.staging_dir, f.path);
      std::string to = JoinPath(tmp, f.path);
      // A part staged without fsync (report() snapshots only) becomes durable here, before the
      // commit point; for a file already fsynced this costs next to nothing.
      if (f.link.empty()) JT_RETURN_IF_ERROR(fs.Fsync(from, /*directory=*/false));
      JT_RETURN_IF_ERROR(fs.Rename(from, to));
      (f.link.empty() ? files : links).push_back(EntryToJson(f, rc.rank));
    }
  }
  nlohmann::json manifest = RecordToJson(record);
  manifest["version"] = 1;
  manifest["file_list"] = files;
  if (in_store) manifest["location"] = "store";
  if (!links.empty()) manifest["links"] = links;
  if (!dir_modes.empty()) manifest["dirs"] = dir_modes;
  nlohmann::json copies = nlohmann::json::array();
  for (const auto& rc : ranks) {
    if (!rc.copy_id.empty()) copies.push_back({{"rank", rc.rank}, {"id", rc.copy_id}});
  }
  if (!copies.empty()) manifest["copies"] = copies;
  JT_RETURN_IF_ERROR(fs.WriteFileAtomically(JoinPath(tmp, kManifestName), manifest.dump(1) + "\n"));
  // The renames above changed directory entries: make them durable before the commit point.
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    JT_RETURN_IF_ERROR(fs.Fsync(*it, /*directory=*/true));
  }

  const std::string final_dir = JoinPath(run_dir, dir_name);
  StatusOr<FileInfo> existing = fs.Stat(final_dir);
  if (existing.ok()) {
    // The commit point for a reused name: swap the new directory in, then drop the old one,
    // which is under .staging/ from then on (swept if this stops before it is removed).
    Status swapped = fs.Exchange(tmp, final_dir);
    if (!swapped.ok()) {
      return Status(swapped.code(),
                    "cannot replace the checkpoint '" + final_dir + "': " + swapped.message());
    }
    JT_RETURN_IF_ERROR(fs.RemoveTree(tmp));
  } else if (existing.status().code() != StatusCode::kNotFound) {
    return existing.status();
  } else {
    Status renamed = fs.Rename(tmp, final_dir);  // the commit point
    if (!renamed.ok()) {
      return Status(renamed.code(),
                    "cannot commit the checkpoint '" + final_dir + "': " + renamed.message());
    }
  }
  JT_RETURN_IF_ERROR(fs.Fsync(run_dir, /*directory=*/true));
  for (const auto& rc : ranks) {
    if (!rc.in_store) JT_RETURN_IF_ERROR(fs.RemoveTree(rc.staging_dir));
  }
  return record;
}

bool InStore(const nlohmann::json& manifest) {
  return manifest.is_object() && manifest.value("location", "") == "store";
}

StatusOr<CheckpointRecord> ReadCheckpointRecord(const std::string& dir, FileSystem& fs) {
  auto text = fs.ReadFile(JoinPath(dir, kManifestName));
  if (!text.ok()) {
    return NotFoundError("'" + dir + "' is not a committed checkpoint: it has no manifest");
  }
  auto manifest = nlohmann::json::parse(*text, nullptr, false);
  auto record = RecordFromJson(manifest);
  if (!record) return DataLossError("the manifest of checkpoint '" + dir + "' is damaged");
  return *record;
}

std::optional<std::vector<FileEntry>> ManifestEntries(const nlohmann::json& manifest) {
  try {
    std::vector<FileEntry> out;
    for (const auto& f : manifest.at("file_list")) {
      out.push_back({.path = f.at("path").get<std::string>(),
                     .size = f.at("size").get<uint64_t>(),
                     .crc32c = f.at("crc32c").get<uint32_t>(),
                     .mode = f.value("mode", uint32_t{0644}),
                     .sha256 = f.value("sha256", std::string())});
    }
    for (const auto& l : manifest.value("links", nlohmann::json::array())) {
      out.push_back({.path = l.at("path").get<std::string>(),
                     .mode = 0777,
                     .link = l.at("target").get<std::string>()});
    }
    for (const auto& e : out) {
      if (!IsCleanRelativePath(e.path) || !IsSha256HexOrEmpty(e.sha256)) return std::nullopt;
    }
    return out;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

namespace {

// One entry of a committed checkpoint against its manifest; `buffer` is this thread's.
Status Cancelled(const std::string& dir) {
  return Status(StatusCode::kCancelled,
                "the verification of checkpoint '" + dir + "' was cancelled");
}

Status VerifyEntry(const std::string& dir, const FileEntry& f, bool checksums,
                   std::vector<char>& buffer, const std::atomic<bool>* cancel) {
  std::string path = JoinPath(dir, f.path);
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    return DataLossError("checkpoint file '" + path + "' is missing");
  }
  if (!f.link.empty()) {
    std::vector<char> buf(PATH_MAX + 1);
    ssize_t n = S_ISLNK(st.st_mode) ? readlink(path.c_str(), buf.data(), buf.size() - 1) : -1;
    if (n < 0 || std::string(buf.data(), static_cast<size_t>(n)) != f.link) {
      return DataLossError("checkpoint link '" + path + "' is not the link to '" + f.link +
                           "' that its manifest lists");
    }
    return OkStatus();
  }
  if (!S_ISREG(st.st_mode)) {
    return DataLossError("checkpoint file '" + path +
                         "' is not a regular file (its manifest lists one); refusing to follow it");
  }
  if (static_cast<uint64_t>(st.st_size) != f.size) {
    return DataLossError("checkpoint file '" + path + "' has " + std::to_string(st.st_size) +
                         " bytes; its manifest says " + std::to_string(f.size));
  }
  if (!checksums) return OkStatus();
  Fd in{open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (in.fd < 0) return PathError("cannot open", path, errno);
  posix_fadvise(in.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  uint32_t crc = 0;
  for (;;) {
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) return Cancelled(dir);
    ssize_t n = read(in.fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PathError("cannot read", path, errno);
    if (n == 0) break;
    crc = Crc32c(crc, buffer.data(), static_cast<size_t>(n));
  }
  if (crc != f.crc32c) {
    return DataLossError("checkpoint file '" + path +
                         "' does not match its checksum: it changed after it was committed");
  }
  return OkStatus();
}

}  // namespace

Status VerifyCheckpoint(const std::string& dir, bool checksums, int threads,
                        const std::atomic<bool>* cancel) {
  auto text = ReadFile(JoinPath(dir, kManifestName));
  if (!text.ok()) {
    return NotFoundError("'" + dir + "' is not a committed checkpoint: it has no manifest");
  }
  const nlohmann::json manifest = nlohmann::json::parse(*text, nullptr, false);
  auto entries = ManifestEntries(manifest);
  if (!entries) return DataLossError("the manifest of checkpoint '" + dir + "' is damaged");
  if (InStore(manifest)) return OkStatus();  // its ranks check what they download of it
  // Largest first, so that one big file starts at once and the small ones fill the other threads.
  std::vector<size_t> order(entries->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return (*entries)[a].size > (*entries)[b].size; });
  if (threads <= 0)
    threads = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  const size_t n_threads =
      std::min(static_cast<size_t>(threads), std::max<size_t>(1, order.size()));
  std::vector<Status> results(entries->size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    std::vector<char> buffer(kCopyChunk);
    for (size_t k = next++; k < order.size() && !failed; k = next++) {
      Status s = cancel != nullptr && cancel->load()
                     ? Cancelled(dir)
                     : VerifyEntry(dir, (*entries)[order[k]], checksums, buffer, cancel);
      if (!s.ok()) failed = true;
      results[order[k]] = std::move(s);
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < n_threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  // A failure stops the others early; of those found, the first in manifest order is returned.
  for (auto& s : results) JT_RETURN_IF_ERROR(s);
  return OkStatus();
}

StatusOr<CheckpointIndex> CheckpointIndex::Load(const std::string& run_dir,
                                                std::vector<std::string>* warnings,
                                                FileSystem& fs) {
  CheckpointIndex index;
  index.run_dir_ = run_dir;
  index.fs_ = &fs;
  const std::string index_path = JoinPath(run_dir, kIndexName);
  auto text = fs.ReadFile(index_path);
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
      if (ReadCheckpointRecord(JoinPath(run_dir, r.dir_name), fs).ok()) {
        index.records_.push_back(std::move(r));
      } else {
        warnings->push_back("checkpoint '" + r.dir_name +
                            "' is in the index but no longer in the run directory; forgetting it");
      }
    }
  }
  // A commit that renamed its directory into place but crashed before updating the index.
  StatusOr<std::vector<std::string>> names = fs.List(run_dir);
  if (names.ok()) std::sort(names->begin(), names->end());
  std::vector<CheckpointRecord> found;
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (!ValidDirName(name)) continue;
    bool known = std::any_of(index.records_.begin(), index.records_.end(),
                             [&](const CheckpointRecord& r) { return r.dir_name == name; });
    if (known) continue;
    auto record = ReadCheckpointRecord(JoinPath(run_dir, name), fs);
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
  return fs_->WriteFileAtomically(JoinPath(run_dir_, kIndexName), j.dump(1) + "\n");
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
                                           const RetentionPolicy& policy,
                                           const std::set<std::string>& pending) {
  if (!policy.num_to_keep || records.empty()) return {};
  const std::string& latest = records.back().dir_name;
  std::vector<CheckpointRecord> settled;
  for (const auto& r : records) {
    if (!pending.contains(r.dir_name)) settled.push_back(r);
  }
  std::vector<CheckpointRecord> ranked = RankByScore(std::move(settled), policy);
  std::vector<std::string> doomed;
  for (size_t i = static_cast<size_t>(*policy.num_to_keep); i < ranked.size(); ++i) {
    if (ranked[i].dir_name != latest) doomed.push_back(ranked[i].dir_name);
  }
  return doomed;
}

Validations ApplyValidations(const std::string& run_dir, std::vector<CheckpointRecord> records,
                             FileSystem& fs) {
  nlohmann::json outcomes = nlohmann::json::object();
  if (StatusOr<std::string> text = fs.ReadFile(JoinPath(run_dir, kValidationName)); text.ok()) {
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("checkpoints") && j["checkpoints"].is_object()) {
      outcomes = j["checkpoints"];
    }
  }
  Validations out;
  for (CheckpointRecord& r : records) {
    auto it = outcomes.find(r.dir_name);
    const bool ended = it != outcomes.end() && it->is_object() &&
                       it->value("round", nlohmann::json()) == nlohmann::json(r.round);
    if (ended) {
      const nlohmann::json metrics = it->value("metrics", nlohmann::json());
      if (metrics.is_object() && r.metrics.is_object()) r.metrics.update(metrics);
    } else if (fs.Stat(JoinPath(JoinPath(run_dir, kValidationRequestsDir),
                                std::to_string(r.round) + ".json"))
                   .ok()) {
      out.pending.insert(r.dir_name);
    }
    out.records.push_back(std::move(r));
  }
  return out;
}

StatusOr<std::vector<std::string>> ApplyRetention(const std::string& run_dir,
                                                  const RetentionPolicy& policy) {
  std::vector<std::string> warnings;
  JT_ASSIGN_OR_RETURN(CheckpointIndex index, CheckpointIndex::Load(run_dir, &warnings));
  Validations v = ApplyValidations(run_dir, index.records());
  std::vector<std::string> doomed = SelectForDeletion(v.records, policy, v.pending);
  if (doomed.empty()) return std::vector<std::string>{};
  for (const auto& d : doomed) index.Remove(d);
  JT_RETURN_IF_ERROR(index.Save());
  std::vector<std::string> out;
  for (const auto& d : doomed) {
    Status s = RemoveTree(JoinPath(run_dir, d));
    if (!s.ok()) out.push_back("cannot delete checkpoint " + d + ": " + s.message());
  }
  return out;
}

Status RemoveTree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return OkStatus();
  int rc = nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, FTW*) { return remove(p) == 0 ? 0 : errno; }, 32,
      FTW_DEPTH | FTW_PHYS);
  if (rc != 0) return PathError("cannot remove", path, rc > 0 ? rc : errno);
  return OkStatus();
}

}  // namespace jaxtrain::storage
