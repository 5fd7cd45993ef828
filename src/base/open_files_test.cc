#include "base/open_files.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

namespace jaxtrain {
namespace {

uint64_t SoftLimit() {
  rlimit now{};
  getrlimit(RLIMIT_NOFILE, &now);
  return now.rlim_cur;
}

TEST(OpenFilesTest, NeverLowersTheLimit) {
  const uint64_t before = SoftLimit();
  ASSERT_TRUE(RaiseOpenFileLimit(16, 16).ok());
  EXPECT_EQ(SoftLimit(), before);
}

TEST(OpenFilesTest, RaisesTheSoftLimitUpToTheHardOne) {
  rlimit now{};
  getrlimit(RLIMIT_NOFILE, &now);
  if (now.rlim_max == RLIM_INFINITY || now.rlim_max < 64) GTEST_SKIP() << "no usable hard limit";
  rlimit low = now;
  low.rlim_cur = 32;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  EXPECT_TRUE(RaiseOpenFileLimit(48, 64).ok());
  EXPECT_GE(SoftLimit(), 64u);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &now), 0);
}

TEST(OpenFilesTest, AnUnreachableNeedIsResourceExhaustedAndNamesTheLimit) {
  // More than any kernel allows (fs.nr_open is at most about a billion), even with the capability.
  Status s = RaiseOpenFileLimit(uint64_t{1} << 40, uint64_t{1} << 40);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("RLIMIT_NOFILE"), std::string::npos);
  EXPECT_NE(s.message().find(std::to_string(uint64_t{1} << 40)), std::string::npos);
}

}  // namespace
}  // namespace jaxtrain
