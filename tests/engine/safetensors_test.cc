// Tests of safetensors export/import and of the defensive header parser.
#include "engine/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine/state_files.h"

namespace ztier::engine {
namespace {

namespace fs = std::filesystem;

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const fs::path& p, const std::string& data) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(data.data(), static_cast<std::streamsize>(data.size()));
}

JobSpec Model(const std::string& name, int ranks) {
  JobSpec j;
  j.name = name;
  j.ranks = ranks;
  j.units = {{"embed", {{"wte", {50, 16}}}},
             {"block", {{"attn.w", {16, 48}}, {"attn.b", {48}}, {"ln.w", {16}}}}};
  return j;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::current_path() / ("st-test-" + std::to_string(::getpid()) + "-" +
                                 ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    Settings s;
    s.dram_budget_bytes = 256 << 20;
    s.optimizer_threads = 1;
    s.pin_memory = false;
    engine_ = std::move(Engine::Create(s)).value();
  }
  void TearDown() override { fs::remove_all(dir_); }

  int Job(const std::string& name, int ranks, std::vector<std::vector<float>>* weights) {
    const int j = *engine_->RegisterJob(Model(name, ranks));
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int k = 0; k < 2; ++k) {
      const UnitLayout l = *engine_->Layout(j, k);
      std::vector<float> w(l.numel);
      for (float& x : w) x = normal(rng);
      EXPECT_TRUE(engine_->WriteWeights(j, k, w.data(), w.size()).ok());
      if (weights) weights->push_back(w);
    }
    return j;
  }

  std::vector<float> Master(int j, int k) {
    const UnitLayout l = *engine_->Layout(j, k);
    std::vector<float> p(l.padded);
    EXPECT_TRUE(engine_->ReadState(j, k, p.data(), nullptr, nullptr).ok());
    p.resize(l.numel);
    return p;
  }

  fs::path dir_;
  std::unique_ptr<Engine> engine_;
};

// A job's state as the file code sees it, whose writes fail from unit
// `fail_at` on with `failure` (ztierd gone, a drive's error, another
// writer's write between two of this one's).
class FailingAccess final : public StateAccess {
 public:
  FailingAccess(const JobDescription& d, size_t fail_at, Status failure)
      : d_(d), fail_at_(fail_at), failure_(std::move(failure)) {}
  Status Read(const Visit& fn) override { return Pass(fn); }
  Status Overwrite(const Visit& fn) override { return Pass(fn); }
  Status UpdateMaster(const Visit& fn) override { return Pass(fn); }
  Status Commit(int64_t, int64_t) override { return Status::Ok(); }

 private:
  Status Pass(const Visit& fn) {
    for (size_t k = 0; k < d_.layouts.size(); ++k) {
      const uint64_t n = d_.layouts[k].padded;
      std::vector<float> f(3 * n);
      ZT_RETURN_IF_ERROR(fn(
          k,
          UnitState{.master = f.data(), .exp_avg = f.data() + n, .exp_avg_sq = f.data() + 2 * n}));
      if (k >= fail_at_) return failure_;
      ++units_written_;
    }
    return Status::Ok();
  }
  const JobDescription& d_;
  size_t fail_at_;
  Status failure_;
};

// An import (through ztierd, unit by unit) that failed after it had
// written a unit said nothing of the job it left: partly imported, every
// save refused until a load or import commits. It says so; one that wrote
// nothing, or that another writer's write stopped (the job holds that
// one's state), does not.
TEST_F(SafetensorsTest, AnImportThatFailsMidwaySaysTheJobIsPartlyImported) {
  const int j = Job("midway", 1, nullptr);
  const fs::path path = dir_ / "w.safetensors";
  ASSERT_TRUE(engine_->ExportSafetensors(j, path.string(), Engine::ExportType::kFloat32).ok());
  JobDescription d;
  d.name = "midway";
  d.units = Model("midway", 1).units;
  for (int k = 0; k < 2; ++k) d.layouts.push_back(*engine_->Layout(j, k));
  const Status gone = Status::IoError("ztierd went away");
  FailingAccess after_one(d, 1, gone);
  Status st = ImportSafetensorsFile(d, after_one, path.string());
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st;
  EXPECT_NE(st.message().find("partly imported"), std::string::npos) << st;
  FailingAccess at_first(d, 0, gone);
  st = ImportSafetensorsFile(d, at_first, path.string());
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st;
  EXPECT_EQ(st.message().find("partly"), std::string::npos) << st;
  FailingAccess superseded(
      d, 1, Status::FailedPrecondition(StrCat("job 'midway': ", kAnotherWriter, " replaced it")));
  st = ImportSafetensorsFile(d, superseded, path.string());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(st.message().find("partly"), std::string::npos) << st;
}

TEST_F(SafetensorsTest, ExportHasNamesShapesAndUnpaddedData) {
  std::vector<std::vector<float>> w;
  const int j = Job("exp", 2, &w);
  for (auto type : {Engine::ExportType::kFloat32, Engine::ExportType::kBFloat16}) {
    const fs::path p = dir_ / "model.safetensors";
    ASSERT_TRUE(engine_->ExportSafetensors(j, p.string(), type).ok());
    const std::string file = ReadAll(p);
    Result<StHeader> h = ParseSafetensorsHeader(file, file.size());
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->data_start % 8, 0u);
    ASSERT_EQ(h->tensors.size(), 4u);
    const StTensor& b = h->tensors.at("attn.b");
    EXPECT_EQ(b.shape, (std::vector<int64_t>{48}));
    EXPECT_EQ(b.dtype_name, type == Engine::ExportType::kFloat32 ? "F32" : "BF16");
    // attn.b is unit 1's second tensor: elements [768, 816) of its flat buffer.
    for (int i = 0; i < 48; ++i) {
      const char* at = file.data() + h->data_start + b.begin;
      float got;
      if (type == Engine::ExportType::kFloat32) {
        std::memcpy(&got, at + i * 4, 4);
        EXPECT_EQ(got, w[1][768 + i]);
      } else {
        uint16_t bits;
        std::memcpy(&bits, at + i * 2, 2);
        EXPECT_EQ(bits, FloatToBf16(w[1][768 + i]).bits);
      }
    }
  }
}

TEST_F(SafetensorsTest, ExportThenImportEqualsTheOriginal) {
  std::vector<std::vector<float>> w;
  const int a = Job("a", 1, &w);
  const fs::path f32 = dir_ / "a.safetensors";
  ASSERT_TRUE(engine_->ExportSafetensors(a, f32.string(), Engine::ExportType::kFloat32).ok());
  const int b = *engine_->RegisterJob(Model("b", 3));  // another rank count
  Status s = engine_->ImportSafetensors(b, f32.string());
  ASSERT_TRUE(s.ok()) << s;
  for (int k = 0; k < 2; ++k) EXPECT_EQ(Master(b, k), w[k]) << "unit " << k;
  EXPECT_EQ(engine_->PublishedStep(b, 0), 0);

  const fs::path bf = dir_ / "a-bf16.safetensors";
  ASSERT_TRUE(engine_->ExportSafetensors(a, bf.string(), Engine::ExportType::kBFloat16).ok());
  const int c = *engine_->RegisterJob(Model("c", 1));
  ASSERT_TRUE(engine_->ImportSafetensors(c, bf.string()).ok());
  for (int k = 0; k < 2; ++k) {
    const std::vector<float> got = Master(c, k);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], Bf16ToFloat(FloatToBf16(w[k][i])));
    }
  }
}

TEST_F(SafetensorsTest, ImportsF16AndRefusesMissingOrMisshapenTensors) {
  const int j = *engine_->RegisterJob(Model("h", 1));
  // Hand-made file: F16 values 1.0, -2.0, a subnormal, and zeros elsewhere.
  std::vector<StEntry> entries = {{"wte", "F16", {50, 16}, 50 * 16 * 2},
                                  {"attn.w", "F16", {16, 48}, 16 * 48 * 2},
                                  {"attn.b", "F16", {48}, 48 * 2},
                                  {"ln.w", "F16", {16}, 16 * 2}};
  std::string file = MakeSafetensorsHeader(entries);
  std::string data(50 * 16 * 2 + 16 * 48 * 2 + 48 * 2 + 16 * 2, '\0');
  const uint16_t halves[3] = {0x3c00, 0xc000, 0x0001};
  std::memcpy(data.data(), halves, 6);
  file += data;
  const fs::path p = dir_ / "f16.safetensors";
  WriteAll(p, file);
  Status s = engine_->ImportSafetensors(j, p.string());
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<float> m = Master(j, 0);
  EXPECT_EQ(m[0], 1.0f);
  EXPECT_EQ(m[1], -2.0f);
  EXPECT_EQ(m[2], std::ldexp(1.0f, -24));

  entries.pop_back();  // no ln.w
  WriteAll(p, MakeSafetensorsHeader(entries) + data.substr(0, data.size() - 32));
  s = engine_->ImportSafetensors(j, p.string());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("ln.w"), std::string::npos) << s;

  // Another shape: both are named (it said only "another shape").
  entries = {{"wte", "F32", {16, 50}, 50 * 16 * 4}};
  WriteAll(p, MakeSafetensorsHeader(entries) + std::string(50 * 16 * 4, '\0'));
  s = engine_->ImportSafetensors(j, p.string());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("tensor 'wte' has shape [16, 50] in the file and [50, 16] in the job"),
            std::string::npos)
      << s;
}

// A NaN or an infinity in the file trained as NaN (every step skipped),
// while a checkpoint holding one is refused: the import refuses it too,
// naming the tensor and the element, and leaves the job as it was.
TEST_F(SafetensorsTest, ImportRefusesWeightsThatAreNotFinite) {
  std::vector<std::vector<float>> weights;
  const int j = Job("nan", 1, &weights);
  const std::vector<StEntry> entries = {{"wte", "F16", {50, 16}, 50 * 16 * 2},
                                        {"attn.w", "F16", {16, 48}, 16 * 48 * 2},
                                        {"attn.b", "F16", {48}, 48 * 2},
                                        {"ln.w", "F16", {16}, 16 * 2}};
  // An F32 past bf16's range (3.4e38: ztier refused its own export of it).
  {
    std::vector<StEntry> f32 = entries;
    f32[2] = {"attn.b", "F32", {48}, 48 * 4};
    std::string data(50 * 16 * 2 + 16 * 48 * 2 + 48 * 4 + 16 * 2, '\0');
    const float huge = 3.4e38f;
    std::memcpy(data.data() + 50 * 16 * 2 + 16 * 48 * 2 + 3 * 4, &huge, 4);  // attn.b[3]
    const fs::path p = dir_ / "huge.safetensors";
    WriteAll(p, MakeSafetensorsHeader(f32) + data);
    const Status s = engine_->ImportSafetensors(j, p.string());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("tensor 'attn.b' element 3 is 3.4e+38"), std::string::npos) << s;
    EXPECT_NE(s.message().find("within bf16's range"), std::string::npos) << s;
    EXPECT_EQ(Master(j, 0), weights[0]);
  }
  for (const uint16_t bad : {uint16_t{0x7c00}, uint16_t{0xfc00}, uint16_t{0x7e00}}) {
    std::string data(50 * 16 * 2 + 16 * 48 * 2 + 48 * 2 + 16 * 2, '\0');
    std::memcpy(data.data() + 50 * 16 * 2 + 16 * 48 * 2 + 3 * 2, &bad, 2);  // attn.b[3]
    const fs::path p = dir_ / "bad.safetensors";
    WriteAll(p, MakeSafetensorsHeader(entries) + data);
    const Status s = engine_->ImportSafetensors(j, p.string());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("tensor 'attn.b' element 3 is "), std::string::npos) << s;
    EXPECT_EQ(Master(j, 0), weights[0]);
  }
}

// A tensor named __metadata__ took the header's metadata key: the export
// wrote a file no reader takes. It is refused, export and import alike.
TEST_F(SafetensorsTest, ATensorNamedLikeTheMetadataHasNoFile) {
  JobSpec spec = Model("meta", 1);
  spec.units[1].tensors[0].name = "__metadata__";
  const int j = *engine_->RegisterJob(spec);
  const fs::path p = dir_ / "meta.safetensors";
  Status s = engine_->ExportSafetensors(j, p.string(), ExportType::kFloat32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("a tensor named '__metadata__'"), std::string::npos) << s;
  EXPECT_FALSE(fs::exists(p));
  s = engine_->ImportSafetensors(j, p.string());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

std::string Header(const std::string& json, uint64_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\0');
}

TEST(SafetensorsHeaderTest, RejectsHeadersThatLie) {
  struct Case {
    std::string file;
    const char* message;
  };
  std::string lying_length(8, '\0');
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(lying_length.data(), &huge, 8);
  const Case cases[] = {
      {"abc", "shorter than"},
      {lying_length + "{}", "implausible"},
      {Header("{}", 0).substr(0, 9), "runs past the end"},
      {Header("{not json", 0), "header: parse error at line 1, column 3"},
      {Header("[1]", 0), "not a JSON object"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2]}})", 8), "lacks"},
      {Header(R"({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", 8),
       "unknown dtype 'Q7'"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8),
       "fall outside"},
      {Header(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8), "need 12"},
      {Header(R"({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8),
       "bad dimension"},
      {Header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
              16),
       "overlap"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8),
       "fall outside"},
      {Header(R"({"__metadata__": {"k": 1}})", 0), "values must be strings"},
      {Header(R"({"t": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296],
                  "data_offsets": [0, 8]}})",
              8),
       "overflows"},
      // What the reference reader refuses too (these were read: the last
      // entry of a repeated name won, bytes no tensor names were skipped,
      // a dimension past 2^63 became negative).
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
              8),
       "key 't' is given twice"},
      // A key given twice inside an entry: the last "dtype" read fp16
      // bytes as bf16. Anything after a NUL byte was dropped.
      {Header(R"({"t": {"dtype": "F16", "dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})",
              4),
       "key 't.dtype' is given twice"},
      // An empty name given twice (a duplicate of '' went unseen).
      {Header(R"({"": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                  "": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})",
              4),
       "key '' is given twice"},
      {Header(std::string(300, '[') + std::string(300, ']'), 0), "nest more than 256 deep"},
      {Header(std::string(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})") +
                  std::string(1, '\0') + "{{{",
              4),
       "a NUL byte"},
      // A shape whose byte count wraps: said as such (it was "needs 0").
      {Header(R"({"t": {"dtype": "F32", "shape": [2147483648, 2147483648],
                  "data_offsets": [0, 512]}})",
              512),
       "past 2^64 bits"},
      {Header(R"({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})", 2),
       "no whole number of bytes"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 12),
       "after the last tensor's data"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12),
       "bytes [0, 4) of the data belong to no tensor"},
      {Header(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                  "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
              12),
       "bytes [4, 8) of the data belong to no tensor"},
      {Header(R"({"t": {"dtype": "F32", "shape": [9223372036854775808, 0],
                  "data_offsets": [0, 0]}})",
              0),
       "past 2^63 - 1"},
  };
  for (const Case& c : cases) {
    Result<StHeader> h = ParseSafetensorsHeader(c.file, c.file.size());
    ASSERT_FALSE(h.ok()) << c.message;
    EXPECT_EQ(h.status().code(), StatusCode::kCorruption);
    EXPECT_NE(h.status().message().find(c.message), std::string::npos)
        << c.message << " -> " << h.status();
  }
  const std::string ok = Header(R"({"t": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
      "__metadata__": {"format": "pt"}})",
                                8);
  EXPECT_TRUE(ParseSafetensorsHeader(ok, ok.size()).ok());
}

// Every dtype the format's writers write is read (sized, validated), a
// complex buffer included: ztier's own export of one was refused as corrupt.
TEST(SafetensorsHeaderTest, ReadsEveryDtypeTheWritersWrite) {
  // Bits an element; 4 elements of each (the packed 4- and 6-bit ones in 2
  // and 3 bytes: a file with one beside the tensors a job takes was
  // refused whole).
  const std::pair<const char*, uint64_t> dtypes[] = {
      {"F64", 64},    {"F32", 32},    {"F16", 16},        {"BF16", 16},       {"I64", 64},
      {"I32", 32},    {"I16", 16},    {"I8", 8},          {"U64", 64},        {"U32", 32},
      {"U16", 16},    {"U8", 8},      {"BOOL", 8},        {"C64", 64},        {"F8_E4M3", 8},
      {"F8_E5M2", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"F4", 4},
      {"F6_E2M3", 6}, {"F6_E3M2", 6},
  };
  for (const auto& [dtype, bits] : dtypes) {
    const uint64_t bytes = 4 * bits / 8;
    const std::string file =
        Header(StrCat(R"({"t": {"dtype": ")", dtype, R"(", "shape": [2, 2], "data_offsets": [0, )",
                      bytes, "]}}"),
               bytes);
    Result<StHeader> h = ParseSafetensorsHeader(file, file.size());
    EXPECT_TRUE(h.ok()) << dtype << ": " << h.status();
  }
}

// A header of many entries is read in time linear in its size: the parser
// rescanned an object each time one of its members closed, and 200k
// entries (13 MB) never finished. (ctest's timeout holds this one.)
TEST(SafetensorsHeaderTest, AHeaderOfManyEntriesIsRead) {
  std::string json = "{";
  for (int i = 0; i < 200000; ++i) {
    json += StrCat(i ? "," : "", R"("t)", i, R"(": {"dtype": "F32", "shape": [0], )",
                   R"("data_offsets": [0, 0]})");
  }
  json += "}";
  const std::string file = Header(json, 0);
  Result<StHeader> h = ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 200000u);
}

TEST(SafetensorsHeaderTest, RandomMutationsAreRejectedOrDescribeAConsistentFile) {
  const std::string good =
      MakeSafetensorsHeader({{"a.w", "F32", {3, 4}, 48}, {"a.b", "BF16", {4}, 8}}) +
      std::string(56, '\1');
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string m = good;
    for (int f = 0; f < 1 + static_cast<int>(rng() % 4); ++f) {
      m[rng() % m.size()] = static_cast<char>(rng());
    }
    if (rng() % 8 == 0) m.resize(rng() % m.size());
    // Must not crash (ASan checks the reads), and must answer sensibly:
    // a rejection says what is wrong; an acceptance describes tensors that
    // fit the file, do not overlap, and hold shape x dtype size bytes.
    Result<StHeader> h = ParseSafetensorsHeader(m, m.size());
    if (!h.ok()) {
      EXPECT_EQ(h.status().code(), StatusCode::kCorruption) << h.status();
      EXPECT_FALSE(h.status().message().empty());
      continue;
    }
    ++accepted;
    ASSERT_LE(h->data_start, m.size());
    const uint64_t data = m.size() - h->data_start;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const auto& [name, t] : h->tensors) {
      ASSERT_LE(t.begin, t.end) << name;
      ASSERT_LE(t.end, data) << name << " ends past the data";
      uint64_t elements = 1;
      for (int64_t d : t.shape) {
        ASSERT_GE(d, 0) << name;
        elements *= static_cast<uint64_t>(d);
      }
      const uint64_t width = t.dtype == StDtype::kF32    ? 4
                             : t.dtype == StDtype::kBF16 ? 2
                             : t.dtype == StDtype::kF16  ? 2
                                                         : 0;
      if (width != 0) {
        EXPECT_EQ(elements * width, t.end - t.begin) << name;
      }
      ranges.emplace_back(t.begin, t.end);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); ++k) {
      EXPECT_LE(ranges[k - 1].second, ranges[k].first) << "overlapping tensors accepted";
    }
  }
  RecordProperty("accepted", accepted);
}

}  // namespace
}  // namespace ztier::engine
