#include "base/status.h"

#include <gtest/gtest.h>

namespace jaxtrain {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("x=" + std::to_string(x) + " is odd");
  return x / 2;
}

Status Quarter(int x, int* out) {
  JT_ASSIGN_OR_RETURN(int half, Half(x));
  JT_ASSIGN_OR_RETURN(*out, Half(half));
  return OkStatus();
}

TEST(StatusTest, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = InvalidArgumentError("bad");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: bad");
}

TEST(StatusOrTest, MacrosPropagateTheFirstError) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Quarter(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "x=3 is odd");
}

TEST(StatusTest, ErrnoErrorNamesTheCall) {
  Status s = ErrnoError("open(/x)", ENOENT);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("open(/x) failed"), std::string::npos);
}

TEST(StatusTest, ErrnoCodesSayWhetherRetryingMayHelp) {
  EXPECT_EQ(ErrnoCode(ENOSPC), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoCode(EDQUOT), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoCode(EIO), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoCode(EACCES), StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoCode(EROFS), StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoCode(EISDIR), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoCode(EBADF), StatusCode::kInternal);
  EXPECT_EQ(ErrnoError("write", ENOSPC).code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace jaxtrain
