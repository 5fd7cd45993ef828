#include "storage/memory_copies.h"

#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "storage/checkpoint.h"
#include "storage/files.h"
#include "storage/filesystem.h"

namespace jaxtrain::storage {
namespace {

nlohmann::json ReadJson(const std::string& path) {
  StatusOr<std::string> text = ReadFile(path);
  return text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
}

// The ids of the copies in one rank's directory of the store.
std::set<std::string> CopyIds(const std::string& rank_dir) {
  std::set<std::string> ids;
  StatusOr<std::vector<std::string>> names = LocalFileSystem().List(rank_dir);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (name.size() <= 5 || !name.ends_with(".json")) continue;
    nlohmann::json copy = ReadJson(JoinPath(rank_dir, name));
    if (copy.is_object() && copy.contains("id") && copy["id"].is_string()) {
      ids.insert(copy["id"].get<std::string>());
    }
  }
  return ids;
}

// A directory (not a link) of this user's that no one else may enter.
bool IsPrivateDir(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
         (st.st_mode & 077) == 0;
}

}  // namespace

bool AllPartsHeldIn(const std::string& store, const std::string& checkpoint_dir) {
  const size_t slash = store.find_last_of('/');
  if (slash == std::string::npos || slash == 0 || !IsPrivateDir(store.substr(0, slash)) ||
      !IsPrivateDir(store)) {
    return false;
  }
  nlohmann::json manifest = ReadJson(JoinPath(checkpoint_dir, kManifestName));
  if (!manifest.is_object() || !manifest.contains("copies") || !manifest["copies"].is_array()) {
    return false;
  }
  try {
    std::map<int, std::string> ids;
    for (const auto& c : manifest["copies"]) ids[c.at("rank").get<int>()] = c.at("id");
    std::set<int> ranks;
    for (const char* list : {"file_list", "links"}) {
      for (const auto& entry : manifest.value(list, nlohmann::json::array())) {
        ranks.insert(entry.at("rank").get<int>());
      }
    }
    for (int rank : ranks) {
      auto id = ids.find(rank);
      if (id == ids.end() ||
          !CopyIds(JoinPath(store, "rank" + std::to_string(rank))).contains(id->second)) {
        return false;
      }
    }
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace jaxtrain::storage
