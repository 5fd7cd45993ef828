#include "wire/socket.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace jaxtrain::wire {
namespace {

using namespace std::chrono_literals;

// The address a connection accepted on `listen_fd` comes from, or "" when none arrives.
std::string AcceptedFrom(int listen_fd) {
  pollfd p{listen_fd, POLLIN, 0};
  if (poll(&p, 1, 30'000) != 1) return "";
  sockaddr_in peer{};
  socklen_t len = sizeof(peer);
  int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
  if (fd < 0) return "";
  close(fd);
  char text[INET_ADDRSTRLEN] = "";
  inet_ntop(AF_INET, &peer.sin_addr, text, sizeof(text));
  return text;
}

// The control port sets TCP_NODELAY and keepalive once, on its listener, and relies on this.
TEST(ListenTest, OptionsSetOnAListenerReachTheConnectionsItAccepts) {
  int port = 0;
  auto listener = Listen("127.0.0.1", 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  int one = 1;
  ASSERT_EQ(setsockopt(*listener, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), 0);
  EnableKeepAlive(*listener);
  auto client = Connect({"127.0.0.1", port}, 10s);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  pollfd p{*listener, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 30'000), 1);
  int accepted = accept4(*listener, nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(accepted, 0);
  auto option = [&](int level, int name) {
    int value = -1;
    socklen_t len = sizeof(value);
    EXPECT_EQ(getsockopt(accepted, level, name, &value, &len), 0);
    return value;
  };
  EXPECT_EQ(option(IPPROTO_TCP, TCP_NODELAY), 1);
  EXPECT_EQ(option(SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPIDLE), 5);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPINTVL), 1);
  EXPECT_EQ(option(IPPROTO_TCP, TCP_KEEPCNT), 5);
  close(accepted);
  close(*client);
  close(*listener);
}

TEST(ConnectTest, ConnectsFromTheSourceAddressGiven) {
  int port = 0;
  auto listener = Listen("127.0.0.1", 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  auto fd = Connect({"127.0.0.1", port}, 10s, "127.0.0.7");
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_EQ(AcceptedFrom(*listener), "127.0.0.7");
  close(*fd);
  close(*listener);
}

TEST(ConnectTest, ASourceThatIsNotAnAddressOfThePeersFamilyIsInvalidAndNamed) {
  int port = 0;
  auto listener = Listen("127.0.0.1", 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  for (const char* source : {"host.example", "::1"}) {
    auto fd = Connect({"127.0.0.1", port}, 10s, source);
    EXPECT_EQ(fd.status().code(), StatusCode::kInvalidArgument) << source;
    EXPECT_NE(fd.status().message().find(source), std::string::npos) << fd.status().message();
  }
  close(*listener);
}

TEST(ConnectTest, ASourceAddressThisHostDoesNotHaveIsInvalid) {
  int port = 0;
  auto listener = Listen("127.0.0.1", 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  auto fd = Connect({"127.0.0.1", port}, 10s, "192.0.2.1");  // TEST-NET-1: never local
  EXPECT_EQ(fd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fd.status().message().find("192.0.2.1"), std::string::npos) << fd.status().message();
  close(*listener);
}

}  // namespace
}  // namespace jaxtrain::wire
