#include "base/strings.h"

#include <gtest/gtest.h>

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
}

}  // namespace
}  // namespace jaxtrain
