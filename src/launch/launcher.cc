#include "launch/launcher.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "base/fd_io.h"

namespace jaxtrain::launch {

void Say(const std::string& line) {
  // A stderr that cannot be written leaves nowhere to say so.
  (void)WriteAll(2, "jaxtrain: " + line + "\n", "write");
}

std::map<std::string, std::string> ProcessSpec::Env() const {
  if (!shared_env) return env;
  std::map<std::string, std::string> out = *shared_env;
  for (const auto& [k, v] : env) out[k] = v;
  return out;
}

StatusOr<UniformGroup> MergeUniform(const std::vector<ProcessSpec>& specs,
                                    const std::set<std::string>& per_rank, std::string_view engine,
                                    const std::set<std::string>& passed) {
  if (specs.empty()) return InvalidArgumentError("no processes to launch");
  const ProcessSpec& first = specs.front();
  const std::map<std::string, std::string> first_env = first.Env();
  UniformGroup group{.argv = first.argv, .cwd = first.cwd, .secret = first.secret};
  std::set<std::string> differing;
  nlohmann::json rank_env = nlohmann::json::object();
  for (const auto& spec : specs) {
    if (spec.argv != first.argv || spec.cwd != first.cwd || spec.secret != first.secret) {
      return InvalidArgumentError("the " + std::string(engine) +
                                  " launcher runs one command for every rank; the ranks' commands "
                                  "or working directories differ");
    }
    group.unset_env.insert(spec.unset_env.begin(), spec.unset_env.end());
    const std::map<std::string, std::string> env = spec.Env();
    std::set<std::string> names;
    for (const auto& [k, v] : env) names.insert(k);
    for (const auto& [k, v] : first_env) names.insert(k);
    for (const auto& name : names) {
      if (per_rank.count(name)) continue;
      auto a = first_env.find(name);
      auto b = env.find(name);
      if (a == first_env.end() || b == env.end() || a->second != b->second) {
        if (passed.count(name)) {
          differing.insert(name);
          continue;
        }
        return InvalidArgumentError("the environment variable " + name +
                                    " differs between ranks, " + "which one " +
                                    std::string(engine) + " launch cannot give");
      }
    }
    group.ranks.insert(group.ranks.end(), spec.ranks.begin(), spec.ranks.end());
  }
  for (const auto& spec : specs) {
    const std::map<std::string, std::string> env = spec.Env();
    nlohmann::json own = nlohmann::json::object();
    for (const auto& name : differing) {
      if (auto it = env.find(name); it != env.end()) own[name] = it->second;
    }
    if (own.empty()) continue;
    for (int rank : spec.ranks) rank_env[std::to_string(rank)] = own;
  }
  for (const auto& [k, v] : first_env) {
    if (!per_rank.count(k) && !differing.count(k)) group.env[k] = v;
  }
  group.unset_env.insert(differing.begin(), differing.end());
  if (!differing.empty()) group.env[kRankEnvVariable] = rank_env.dump();
  return group;
}

StatusOr<std::string> AddressTowards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(host.c_str(), "9", &hints, &found);
  if (rc != 0) {
    return UnavailableError("cannot resolve '" + host + "': " + gai_strerror(rc));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    // connect() on a UDP socket only picks the route and the source address.
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      error = std::strerror(errno);
      close(fd);
      continue;
    }
    close(fd);
    char text[INET6_ADDRSTRLEN] = "";
    const void* addr =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    inet_ntop(local.ss_family, addr, text, sizeof(text));
    freeaddrinfo(found);
    return std::string(text);
  }
  freeaddrinfo(found);
  return UnavailableError("no route from this host to '" + host + "': " + error);
}

StatusOr<std::vector<std::string>> ProbeUntil(
    const std::function<StatusOr<std::vector<std::string>>()>& probe, Duration wait, int cancel_fd,
    const std::atomic<bool>& interrupted) {
  const auto give_up = std::chrono::steady_clock::now() + wait;
  Duration retry = std::chrono::seconds(1);
  for (;;) {
    JT_ASSIGN_OR_RETURN(std::vector<std::string> down, probe());
    auto now = std::chrono::steady_clock::now();
    if (down.empty() || now >= give_up) return down;
    const auto until = now + std::min<Duration>(retry, give_up - now);
    while ((now = std::chrono::steady_clock::now()) < until) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
      pollfd cancel{cancel_fd, POLLIN, 0};
      if (poll(&cancel, 1, static_cast<int>(std::min<int64_t>(ms, 200))) > 0 ||
          interrupted.load()) {
        return CancelledError(
            "the run is being stopped: the hosts were not asked about to the end");
      }
    }
    retry = std::min<Duration>(retry * 2, std::chrono::seconds(10));
  }
}

}  // namespace jaxtrain::launch
