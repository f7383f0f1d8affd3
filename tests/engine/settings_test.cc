// Tests of the settings table: a DeepSpeed-style config, unknown keys, wrong
// types and values, syntax errors with a position, environment overrides,
// contradicting paths, validation and the non-default listing.
#include "engine/settings.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace ztier::engine {
namespace {

TEST(SettingsTest, ReadsDeepSpeedOffloadConfig) {
  const char* json = R"({
    "zero_optimization": {
      "stage": 3,
      "overlap_comm": true,
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme0/ztier", "/nvme1/ztier"],
                            "pin_memory": false, "buffer_count": 6},
      "offload_param": {"device": "cpu", "nvme_path": "/nvme0/ztier,/nvme1/ztier"}
    },
    "aio": {"block_size": 2097152, "queue_depth": 32, "thread_count": 1},
    "ztier": {"dram_budget": "48G", "nvme_capacity": "2T", "huge_pages": "hugetlb",
              "checksums": false, "optimizer_threads": 12}
  })";
  Result<Settings> s = ParseSettings(json, "ds_config.json");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->optimizer_tier, Tier::kNvme);
  EXPECT_EQ(s->param_tier, Tier::kDram);
  EXPECT_EQ(s->nvme_paths, (std::vector<std::string>{"/nvme0/ztier", "/nvme1/ztier"}));
  EXPECT_FALSE(s->pin_memory);
  EXPECT_EQ(s->buffer_count, 6u);
  EXPECT_EQ(s->stripe_bytes, 2u << 20);
  EXPECT_EQ(s->queue_depth, 32u);
  EXPECT_EQ(s->dram_budget_bytes, uint64_t{48} << 30);
  EXPECT_EQ(s->nvme_capacity_per_path, uint64_t{2} << 40);
  EXPECT_EQ(s->huge_pages, HugePages::kHugetlb);
  EXPECT_FALSE(s->checksums);
  EXPECT_EQ(s->optimizer_threads, 12);
  EXPECT_TRUE(Validate(*s).ok());
  const std::vector<std::string> changed = NonDefaultSettings(*s);
  EXPECT_EQ(changed.size(), 11u);
  EXPECT_NE(std::find(changed.begin(), changed.end(), "aio.queue_depth = 32"), changed.end());
}

TEST(SettingsTest, ReadsStage3ClientSettingsAsDeepSpeedWritesThem) {
  Result<Settings> s = ParseSettings(
      R"({"zero_optimization": {"stage3_max_live_parameters": 1e9,
                               "stage3_param_persistence_threshold": 100000},
          "ztier": {"prefetch_depth": 3}})",
      "ds_config.json");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->max_live_parameters, 1000000000u);
  EXPECT_EQ(s->param_persistence_threshold, 100000u);
  EXPECT_EQ(s->prefetch_depth, 3);
  Result<Settings> frac =
      ParseSettings(R"({"zero_optimization": {"stage3_max_live_parameters": 1.5}})", "x.json");
  ASSERT_FALSE(frac.ok());
  EXPECT_NE(frac.status().ToString().find("stage3_max_live_parameters"), std::string::npos);
  const char* env[] = {"ZTIER_PREFETCH_DEPTH=0", "ZTIER_MAX_LIVE_PARAMETERS=64M", nullptr};
  Result<Settings> e = ApplyEnvironment(*s, env);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->prefetch_depth, 0);
  EXPECT_EQ(e->max_live_parameters, uint64_t{64} << 20);
}

TEST(SettingsTest, EmptyObjectKeepsDefaults) {
  Result<Settings> s = ParseSettings("{}", "x");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, Settings());
  EXPECT_TRUE(NonDefaultSettings(*s).empty());
}

struct BadCase {
  const char* json;
  const char* message;
};

TEST(SettingsTest, RejectsBadConfigsNamingTheKey) {
  const BadCase cases[] = {
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_pth": "/x"}}})",
       "unknown key 'zero_optimization.offload_optimizer.nvme_pth'"},
      {R"({"train_batch_size": 8})", "unknown key 'train_batch_size'"},
      {R"({"aio": {"queue_depth": "deep"}})", "aio.queue_depth: 'deep' is not an integer"},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: 0 is outside 1..4096"},
      {R"({"aio": {"queue_depth": 1.5}})", "aio.queue_depth: 1.5 is not an integer"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: 1000 is not a multiple of 4096"},
      {R"({"aio": 7})", "'aio' must be an object"},
      {R"({"ztier": {"dram_budget": "12Q"}})", "ztier.dram_budget: unknown size suffix"},
      {R"({"ztier": {"dram_budget": 0}})", "ztier.dram_budget: must be > 0"},
      {R"({"ztier": {"checksums": "maybe"}})", "ztier.checksums: 'maybe' is not a boolean"},
      {R"({"ztier": {"huge_pages": {}}})", "ztier.huge_pages: expected a scalar, got object"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       "device 'gpu' is not cpu or nvme"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": [1]}}})",
       "list items must be strings"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": "/a"},
                                  "offload_param": {"nvme_path": "/b"}}})",
       "both must name the same list"},
      {R"([1, 2])", "must be a JSON object"},
      {"{\"aio\": {\n  \"queue_depth\": 4,\n}}", "parse error"},
      {"", "parse error"},
  };
  for (const BadCase& c : cases) {
    Result<Settings> s = ParseSettings(c.json, "cfg.json");
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(s.status().message().find(c.message), std::string::npos)
        << c.json << " -> " << s.status();
    EXPECT_NE(s.status().message().find("cfg.json"), std::string::npos) << s.status();
  }
}

TEST(SettingsTest, SyntaxErrorsCarryAPosition) {
  Result<Settings> s = ParseSettings("{\"aio\": {\"queue_depth\": 4,, }}", "cfg.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("line 1, column 27"), std::string::npos) << s.status();
}

TEST(SettingsTest, EnvironmentOverridesTheFile) {
  Result<Settings> file = ParseSettings(
      R"({"aio": {"queue_depth": 8}, "zero_optimization": {"offload_optimizer": {"nvme_path": "/a"}}})",
      "f");
  ASSERT_TRUE(file.ok());
  const char* env[] = {"PATH=/usr/bin",          "ZTIER_QUEUE_DEPTH=64",
                       "ZTIER_NVME_PATHS=/x,/y", "ZTIER_OPTIMIZER_DEVICE=nvme",
                       "ZTIER_DRAM_BUDGET=3G",   nullptr};
  Result<Settings> s = ApplyEnvironment(*file, env);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->queue_depth, 64u);
  EXPECT_EQ(s->nvme_paths, (std::vector<std::string>{"/x", "/y"}));
  EXPECT_EQ(s->optimizer_tier, Tier::kNvme);
  EXPECT_EQ(s->dram_budget_bytes, uint64_t{3} << 30);
  const char* bad[] = {"ZTIER_QUEUE_DEPTH=lots", nullptr};
  Result<Settings> b = ApplyEnvironment(Settings(), bad);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("ZTIER_QUEUE_DEPTH"), std::string::npos) << b.status();
}

TEST(SettingsTest, ValidateNeedsPathsForNvme) {
  Settings s;
  s.optimizer_tier = Tier::kNvme;
  Status v = Validate(s);
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("nvme_path"), std::string::npos) << v;
  s.nvme_paths = {"/x"};
  EXPECT_TRUE(Validate(s).ok());
}

TEST(SettingsTest, LoadsFilesAndReportsMissingOnes) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("ztier-settings-" + std::to_string(::getpid()) + ".json");
  std::ofstream(p) << R"({"aio": {"queue_depth": 12}})";
  Result<Settings> s = LoadSettings(p.string());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->queue_depth, 12u);
  std::filesystem::remove(p);
  EXPECT_EQ(LoadSettings(p.string()).status().code(), StatusCode::kNotFound);
}

TEST(SettingsTest, RandomMutationsNeverCrash) {
  const std::string good = R"({"zero_optimization": {"offload_optimizer": {"device": "nvme",
      "nvme_path": ["/a", "/b"], "buffer_count": 4}}, "aio": {"block_size": 1048576,
      "queue_depth": 16}, "ztier": {"dram_budget": "8G"}})";
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 2000; ++i) {
    std::string m = good;
    for (int f = 0; f < 1 + static_cast<int>(rng() % 4); ++f) {
      m[rng() % m.size()] = static_cast<char>(rng() % 128);
    }
    Result<Settings> s = ParseSettings(m, "fuzz");
    if (!s.ok()) {
      EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

TEST(SettingsTest, ReadmeDocumentsEverySetting) {
  std::ifstream in(std::string(ZTIER_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(in) << "README.md not found";
  const std::string readme((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream rows(DescribeSettings());
  std::string row;
  while (std::getline(rows, row)) {
    EXPECT_NE(readme.find(row), std::string::npos) << "README lacks the settings line:\n" << row;
  }
}

TEST(SettingsTest, DescriptionListsEveryEnvironmentVariable) {
  const std::string d = DescribeSettings();
  for (const char* env : {"ZTIER_DRAM_BUDGET", "ZTIER_NVME_PATHS", "ZTIER_QUEUE_DEPTH",
                          "ZTIER_STRIPE_BYTES", "ZTIER_CHECKSUMS", "ZTIER_BUFFER_COUNT"}) {
    EXPECT_NE(d.find(env), std::string::npos) << env;
  }
}

}  // namespace
}  // namespace ztier::engine
