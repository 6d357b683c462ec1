#include <gtest/gtest.h>
TEST(Placeholder, Pending) { GTEST_FAIL() << "not written yet"; }
