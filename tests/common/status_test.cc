// Tests for Status / Result<T>, the errno mapping and the macros.
#include "common/status.h"

#include <cerrno>
#include <memory>
#include <string>

#include <gtest/gtest.h>

namespace ztier {
namespace {

TEST(StatusTest, OkIsDefaultAndCheap) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "ok");
  EXPECT_EQ(s.sys_errno(), 0);
}

TEST(StatusTest, CarriesCodeMessageAndErrno) {
  Status s = Status::IoError("read /x", EIO);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_EQ(s.ToString(), "io_error: read /x");
}

TEST(StatusTest, AnnotatePrependsContextAndKeepsCode) {
  Status s = Status::NotFound("unit 3").Annotate("job llama").Annotate("fetch");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "fetch: job llama: unit 3");
  EXPECT_TRUE(Status().Annotate("x").ok());
}

TEST(StatusTest, PosixErrorMapsErrnoAndAcceptsNegative) {
  EXPECT_EQ(PosixError("write /swap", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(PosixError("open /swap", -ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(PosixError("open /swap", -ENOENT).sys_errno(), ENOENT);
  EXPECT_EQ(PosixError("x", EINVAL).code(), StatusCode::kInvalidArgument);
  Status s = PosixError("pread /nvme0/swap offset 4096", EIO);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("pread /nvme0/swap offset 4096: "), std::string::npos);
  EXPECT_NE(s.message().find("(errno 5)"), std::string::npos);
}

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument(StrCat(x, " is odd"));
  return x / 2;
}

Result<int> Quarter(int x) {
  ZT_ASSIGN_OR_RETURN(int h, Half(x));
  ZT_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  ZT_RETURN_IF_ERROR(Half(x));
  return Status::Ok();
}

TEST(ResultTest, ValueAndErrorPaths) {
  Result<int> q = Quarter(12);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 3);
  Result<int> bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "3 is odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(5).code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r(std::make_unique<int>(7));
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

TEST(ResultTest, OkStatusWithoutValueBecomesInternalError) {
  Result<int> r{Status::Ok()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  Result<int> r{Status::NotFound("nothing")};
  EXPECT_DEATH((void)r.value(), "value\\(\\) of an error Result: not_found: nothing");
}

TEST(CheckDeathTest, CheckPrintsFileLineAndMessage) {
  EXPECT_DEATH(ZT_CHECK_MSG(1 + 1 == 3, "math is ", "broken"),
               "check failed at .*status_test.cc:[0-9]+: 1 \\+ 1 == 3: math is broken");
}

}  // namespace
}  // namespace ztier
