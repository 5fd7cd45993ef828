#include "base/strings.h"

#include <gtest/gtest.h>

#include <limits>

namespace jaxtrain {
namespace {

TEST(TrimTest, DropsWhitespaceAtBothEndsOnly) {
  EXPECT_EQ(Trim("  a b\t\r\n"), "a b");
  EXPECT_EQ(Trim("\tRUNNING None\n"), "RUNNING None");
  EXPECT_EQ(Trim(" \n "), "");
  EXPECT_EQ(Trim(""), "");
}

TEST(JoinTest, PutsTheSeparatorBetweenItems) {
  EXPECT_EQ(Join({}, ", "), "");
  EXPECT_EQ(Join({"a"}, ", "), "a");
  EXPECT_EQ(Join({"a", "", "c"}, ","), "a,,c");
}

TEST(FormatNumberTest, WritesNumbersAsUsersDo) {
  EXPECT_EQ(FormatNumber(4), "4");
  EXPECT_EQ(FormatNumber(0.5), "0.5");
  EXPECT_EQ(FormatNumber(1e-6), "1e-06");
  EXPECT_EQ(FormatNumber(-1), "-1");
  EXPECT_EQ(FormatNumber(0), "0");
  EXPECT_EQ(FormatNumber(1e-05), "1e-05");
  EXPECT_EQ(FormatNumber(0.1234567), "0.1234567");  // not rounded to 6 digits
  EXPECT_EQ(FormatNumber(1234567), "1234567");
  EXPECT_EQ(FormatNumber(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatNumber(1e300), "1e+300");
  EXPECT_EQ(FormatNumber(std::numeric_limits<double>::infinity()), "inf");
}

}  // namespace
}  // namespace jaxtrain
