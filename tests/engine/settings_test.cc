// Tests of the settings table: a DeepSpeed-style config, unknown keys, wrong
// types and values, syntax errors with a position, environment overrides,
// contradicting paths, validation and the non-default listing.
#include "engine/settings.h"

#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
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
  EXPECT_EQ(changed.size(),
            12u);  // 11 values off their default, and offload_param.device = cpu as set
  EXPECT_NE(std::find(changed.begin(), changed.end(), "aio.queue_depth = 32 (from ds_config.json)"),
            changed.end());
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
  // Counts whose bytes would wrap (2^63 + 1 parameters: a cap of 2 bytes;
  // 2^63: of 0, no cap) are refused.
  for (const char* over : {"ZTIER_MAX_LIVE_PARAMETERS=9223372036854775809",
                           "ZTIER_PARAM_PERSISTENCE_THRESHOLD=9223372036854775808"}) {
    const char* big[] = {over, nullptr};
    Result<Settings> wrapped = ApplyEnvironment(*s, big);
    ASSERT_FALSE(wrapped.ok()) << over;
    EXPECT_NE(wrapped.status().ToString().find("parameters is more than"), std::string::npos)
        << wrapped.status();
  }
}

// A byte-order mark (Windows editors write one) before a comment or a line
// break: it was taken as a value, and a comma the user never wrote failed
// the parse.
TEST(SettingsTest, AByteOrderMarkIsNotTheConfigs) {
  for (const char* text :
       {"\xEF\xBB\xBF// DeepSpeed config\n{\n \"gradient_clipping\": 0.5\n}\n",
        "\xEF\xBB\xBF\n{\"gradient_clipping\": 0.5}", "\xEF\xBB\xBF{\"gradient_clipping\": 0.5}"}) {
    Result<Settings> s = ParseSettings(text, "c.json");
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->training.clip_norm, 0.5f);
  }
}

TEST(SettingsTest, EmptyObjectKeepsDefaults) {
  Result<Settings> s = ParseSettings("{}", "x");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, Settings());
  EXPECT_TRUE(NonDefaultSettings(*s).empty());
}

// DeepSpeed's configs give offload_param's and offload_optimizer's copies
// of a setting alike: that is one value.
TEST(SettingsTest, TwoKeysOfOneSettingThatAgreeAreOneValue) {
  Result<Settings> s = ParseSettings(
      R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 6, "pin_memory": false},
                                "offload_param": {"buffer_count": 6, "pin_memory": false}}})",
      "x");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->buffer_count, 6u);
  EXPECT_FALSE(s->pin_memory);
}

struct BadCase {
  const char* json;
  const char* message;
};

// An unknown key is compared with every setting's for a suggestion: a key
// of 80 KB took 15 s (a 16 MiB config, an hour) before it was refused.
TEST(SettingsTest, AHugeUnknownKeyIsRefusedAtOnce) {
  const std::string key(400 << 10, 'a');
  for (const std::string& json :
       {StrCat("{\"", key, "\": 1}"), StrCat("{\"ztier\": {\"", key, "\": 1}}")}) {
    const auto t0 = std::chrono::steady_clock::now();
    Result<Settings> s = ParseSettings(json, "cfg.json");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("unknown key"), std::string::npos);
    EXPECT_LT(seconds, 5.0) << "the suggestion's search is quadratic again";
  }
  // A near miss is still suggested.
  Result<Settings> near = ParseSettings(R"({"ztier": {"dram_budgte": "1G"}})", "cfg.json");
  ASSERT_FALSE(near.ok());
  EXPECT_NE(near.status().message().find("did you mean 'ztier.dram_budget'"), std::string::npos)
      << near.status();
}

TEST(SettingsTest, RejectsBadConfigsNamingTheKey) {
  const BadCase cases[] = {
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_pth": "/x"}}})",
       "unknown key 'zero_optimization.offload_optimizer.nvme_pth'"},
      {R"({"train_batch_sise": 8})", "unknown key 'train_batch_sise'"},
      {R"({"aio": {"queue_depth": "deep"}})", "aio.queue_depth: expected a number, got string"},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: 0 is outside 1..4096"},
      {R"({"aio": {"queue_depth": 1.5}})", "aio.queue_depth: '1.5' is not an integer"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: 1000 is not a multiple of 4096"},
      {R"({"aio": 7})", "'aio' must be an object"},
      {R"({"ztier": {"dram_budget": "12Q"}})", "ztier.dram_budget: '12Q' is not a size"},
      {R"({"ztier": {"dram_budget": 0}})", "ztier.dram_budget: must be > 0"},
      {R"({"ztier": {"dram_budget": 64}})",
       "ztier.dram_budget: 64 bytes is less than 1 MiB, too little for any job (a number is "
       "bytes: give a unit, as in \"64G\" for GiB)"},
      {R"({"ztier": {"dram_budget": "1K"}})",
       "ztier.dram_budget: 1K is less than 1 MiB, too little for any job"},
      {R"({"ztier": {"checksums": "maybe"}})",
       "ztier.checksums: expected true or false, got string"},
      {R"({"ztier": {"huge_pages": {}}})", "ztier.huge_pages: expected a string, got object"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       "device 'gpu' is not cpu, nvme or none"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": 5}}})",
       "nvme_path: expected a string or a list of strings, got number"},
      {R"({"zero_optimization": {"offload_optimizer": {"buffer_count": "4"}}})",
       "buffer_count: expected a number, got string"},
      {R"({"zero_optimization": {"offload_param": {"pin_memory": "true"}}})",
       "pin_memory: expected true or false, got string"},
      // fp32 keeps them: an lr of 1e-50 trained at 0, one of 1e39 was "inf".
      {R"({"optimizer": {"params": {"lr": 1e-50}}})",
       "optimizer.params.lr: 1e-50 is outside what fp32 holds"},
      {R"({"optimizer": {"params": {"weight_decay": 1e-46}}})",
       "weight_decay: 1e-46 is outside what fp32 holds"},
      {R"({"aio": {"queue_depth": 4}, "aio": {"queue_depth": 8}})", "key 'aio' is given twice"},
      {R"({"aio": {"queue_depth": 4, "queue_depth": 8}})", "key 'aio.queue_depth' is given twice"},
      {R"({"optimizer": {"type": "Lamb"}})", "'Lamb' is not an optimizer ztier runs"},
      {R"({"optimizer": {"params": {"amsgrad": true}}})", "no AMSGrad"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "expected a list of two numbers"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", "betas must be below 1"},
      {R"({"optimizer": {"params": {"lr": "fast"}}})", "expected a number"},
      {R"({"gradient_clipping": -1})", "gradient_clipping: -1 is outside"},
      {R"({"activation_checkpointing": {"partition_activation": true}})",
       "unknown key 'activation_checkpointing.partition_activation'"},
      {R"({"fp16": {"enabeld": true}})", "unknown key 'fp16.enabeld'"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": [1]}}})",
       "list items must be strings"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": "/a"},
                                  "offload_param": {"nvme_path": "/b"}}})",
       "both must name the same list"},
      // Two keys of one setting that disagree (the keys go in sorted order):
      // one value won, and was logged under the other's key.
      {R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 8},
                                  "offload_param": {"buffer_count": 3}}})",
       "'zero_optimization.offload_param.buffer_count' is 3 but "
       "'zero_optimization.offload_optimizer.buffer_count', the same setting, is 8"},
      {R"({"zero_optimization": {"offload_param": {"pin_memory": false},
                                  "offload_optimizer": {"pin_memory": true}}})",
       "the same setting, is true"},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": 100,
                                  "param_persistence_threshold": 200}})",
       "the same setting, is 200"},
      {R"([1, 2])", "must be a JSON object"},
      {"{\"aio\": {\"queue_depth\": 4 5}}", "parse error"},
      {"", "parse error"},
      // Taken as "{}" once: a comma that follows no value, a comment that
      // never ends (it hid the rest of the file).
      {"{,}", "parse error"},
      {R"({"ztier": {,}})", "parse error"},
      {"[1,,]", "parse error"},
      {"{\"ztier\": {}} /* never closed", "parse error"},
      {"{\"ztier\": {/* never closed \n \"dram_budget\": \"1G\"}}", "parse error"},
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
  Result<Settings> s = ParseSettings("{\"aio\":\n {\"queue_depth\": 4,, }}", "cfg.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("line 2, column"), std::string::npos) << s.status();
}

// DeepSpeed reads configs with hjson, and its documentation's examples
// depend on it. Each of these is copied verbatim from DeepSpeed's docs.
TEST(SettingsTest, ReadsTheDeepSpeedDocumentationConfigsVerbatim) {
  // https://www.deepspeed.ai/tutorials/zero-offload/ (a trailing comma and
  // a missing comma, as published).
  const char* zero_offload = R"({
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
        }
        "contiguous_gradients": true,
        "overlap_comm": true
    }
})";
  Settings nvme_default;
  nvme_default.optimizer_tier = Tier::kNvme;
  Result<Settings> a = ParseSettings(zero_offload, "zero-offload.json", nvme_default);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->optimizer_tier, Tier::kDram) << "the config's device must win over the base";

  // https://www.deepspeed.ai/tutorials/zero/ "Offloading to CPU and NVMe
  // with ZeRO-Infinity".
  const char* zero_infinity = R"({
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": true,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "cpu"
         },
        "offload_param": {
            "device": "cpu"
       }
   }
})";
  Result<Settings> b = ParseSettings(zero_infinity, "zero-infinity.json");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->max_live_parameters, 1000000000u);
  EXPECT_EQ(b->param_persistence_threshold, 100000u);

  // The NVMe form: https://www.deepspeed.ai/docs/config-json/ offload_param,
  // offload_optimizer and aio blocks with their documented values.
  const char* nvme = R"({
  "zero_optimization": {
    "stage": 3,
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    },
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "ratio": 0.3,
      "buffer_count": 5,
      "fast_init": false
    }
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  }
})";
  Result<Settings> c = ParseSettings(nvme, "zero-infinity-nvme.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer_tier, Tier::kNvme);
  EXPECT_EQ(c->param_tier, Tier::kNvme) << "offload_param.device nvme must put params on nvme";
  EXPECT_EQ(c->nvme_paths, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(c->buffer_count, 5u);
  EXPECT_EQ(c->queue_depth, 8u);
  EXPECT_TRUE(Validate(*c).ok());

  // DeepSpeedExamples' ZeRO-Infinity config misspells a key; the typo is
  // named rather than silently dropped.
  Result<Settings> typo = ParseSettings(
      R"({"zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 1e5}})",
      "ds_zero_stage_infinity_config.json");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("stage3_param_persitence_threshold"), std::string::npos);
}

TEST(SettingsTest, ReadsATypicalZero3TrainingConfig) {
  const char* json = R"({
    // A Hugging Face style ZeRO-3 full-offload config.
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 10,
    "wall_clock_breakdown": false,
    "bf16": {"enabled": true},
    "fp16": {"enabled": "auto"},
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                             "weight_decay": 0.1, "torch_adam": false}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                                 "contiguous_memory_optimization": false,
                                 "number_checkpoints": null,
                                 "synchronize_checkpoint_boundary": false, "profile": false},
    "zero_optimization": {"stage": 3, "overlap_comm": true,
                          "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "offload_param": {"device": "cpu", "pin_memory": true},
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_gather_16bit_weights_on_model_save": true},
  })";
  ::testing::internal::CaptureStderr();
  Result<Settings> s = ParseSettings(json, "ds_config.json");
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.status();
  const TrainingSettings& t = s->training;
  EXPECT_EQ(t.train_batch, 64);
  EXPECT_EQ(t.micro_batch, 8);
  EXPECT_EQ(t.grad_accumulation, 4);
  EXPECT_FLOAT_EQ(*t.clip_norm, 0.5f);
  EXPECT_TRUE(*t.activation_checkpointing);
  const cpu_adam::Hyper h = TrainingHyper(*s, {});
  EXPECT_FLOAT_EQ(h.lr, 3e-4f);
  EXPECT_FLOAT_EQ(h.beta2, 0.95f);
  EXPECT_FLOAT_EQ(h.weight_decay, 0.1f);
  EXPECT_EQ(h.mode, cpu_adam::Mode::kAdamW);
  // The ignored keys are listed once, in one line.
  EXPECT_NE(log.find("are ignored: "), std::string::npos) << log;
  EXPECT_NE(log.find("scheduler"), std::string::npos) << log;
  EXPECT_NE(log.find("zero_optimization.stage3_gather_16bit_weights_on_model_save"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("ignored", log.find("ignored") + 1), std::string::npos) << log;
}

// Through ztierd a client warns of each engine setting it set: a list of
// its own left ztier.poison_released_params out, dropped without a word.
TEST(SettingsTest, TheEngineOnlySettingsAreEveryRowNeitherAClientsNorTheJobs) {
  const char* env[] = {"ZTIER_POISON_RELEASED_PARAMS=true",
                       "ZTIER_DRAM_BUDGET=1G",
                       "ZTIER_STATE_DTYPE=int8",
                       "ZTIER_LR=0.1",
                       "ZTIER_PREFETCH_DEPTH=2",
                       nullptr};
  Result<Settings> s = ApplyEnvironment(Settings(), env);
  ASSERT_TRUE(s.ok()) << s.status();
  std::map<std::string, std::string> engine;
  for (const auto& [key, from] : EngineOnlySettingsSet(*s)) engine[key] = from;
  EXPECT_EQ(engine, (std::map<std::string, std::string>{
                        {"ztier.dram_budget", "ZTIER_DRAM_BUDGET"},
                        {"ztier.poison_released_params", "ZTIER_POISON_RELEASED_PARAMS"}}));
}

TEST(SettingsTest, AdamFollowsDeepSpeedsAdamWMode) {
  Result<Settings> adam = ParseSettings(R"({"optimizer": {"type": "Adam"}})", "x");
  ASSERT_TRUE(adam.ok());
  EXPECT_EQ(TrainingHyper(*adam, {}).mode, cpu_adam::Mode::kAdamW);
  Result<Settings> l2 =
      ParseSettings(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})", "x");
  ASSERT_TRUE(l2.ok());
  EXPECT_EQ(TrainingHyper(*l2, {}).mode, cpu_adam::Mode::kAdam);
  EXPECT_EQ(TrainingHyper(Settings(), {.lr = 0.5f}).lr, 0.5f) << "unset keeps the program's";
  // AdamW with adam_w_mode false: decoupled, as DeepSpeed runs it (a
  // DeepSpeed config that says both is taken as it is there).
  Result<Settings> both =
      ParseSettings(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", "x");
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE(Validate(*both).ok());
  EXPECT_EQ(TrainingHyper(*both, {}).mode, cpu_adam::Mode::kAdamW);
}

TEST(SettingsTest, PrecedenceIsDefaultsConfigEnvironmentFlagsAndEachSourceIsNamed) {
  Settings base;
  base.optimizer_tier = Tier::kNvme;  // a program's own default
  Result<Settings> file = ParseSettings(
      R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "aio": {"queue_depth": 8},
          "optimizer": {"params": {"lr": 0.01}}})",
      "cfg.json", base);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->optimizer_tier, Tier::kDram);
  const char* env[] = {"ZTIER_QUEUE_DEPTH=12", "ZTIER_LR=0.02", nullptr};
  Result<Settings> e = ApplyEnvironment(*file, env);
  ASSERT_TRUE(e.ok());
  Result<Settings> f = ApplySetting(*e, "optimizer.params.lr", "0.03", "--lr");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FLOAT_EQ(*f->training.lr, 0.03f);
  EXPECT_EQ(f->queue_depth, 12u);
  const std::vector<std::string> lines = NonDefaultSettings(*f);
  auto has = [&](const std::string& line) {
    return std::find(lines.begin(), lines.end(), line) != lines.end();
  };
  EXPECT_TRUE(has("aio.queue_depth = 12 (from ZTIER_QUEUE_DEPTH)"));
  EXPECT_TRUE(has("optimizer.params.lr = 0.03 (from --lr)"));
  EXPECT_TRUE(has("zero_optimization.offload_optimizer.device = cpu (from cfg.json)"))
      << "a value set to the default is still listed with its source";
  Result<Settings> bad = ApplySetting(*f, "ZTIER_QUEUE_DEPTH", "0", "--qd");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--qd"), std::string::npos) << bad.status();
  EXPECT_FALSE(ApplySetting(*f, "no.such", "1", "--x").ok());
  EXPECT_FALSE(ApplySetting(*f, "ZTIER_NVME_PATHS", ",", "--swap-dir").ok());
  // A path left out between commas, or after one, is a typo (it became
  // /a,/b silently, while the file refused an empty path).
  for (const char* typo : {"/a,,/b", "/a,/b,", ",/a"}) {
    Result<Settings> empty = ApplySetting(*f, "ZTIER_NVME_PATHS", typo, "--swap-dir");
    ASSERT_FALSE(empty.ok()) << typo;
    EXPECT_NE(empty.status().message().find("names an empty path"), std::string::npos)
        << empty.status();
  }
  // One directory twice: refused as the list is read (a command line's
  // contradiction, not a failure of the run).
  for (const char* twice : {"/a,/a", "/a,/b,/a/"}) {
    Result<Settings> again = ApplySetting(*f, "ZTIER_NVME_PATHS", twice, "--swap-dir");
    ASSERT_FALSE(again.ok()) << twice;
    EXPECT_NE(again.status().message().find("names /a twice"), std::string::npos) << again.status();
  }
  EXPECT_TRUE(ApplySetting(*f, "ZTIER_NVME_PATHS", "/a,/b", "--swap-dir").ok());
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

// Settings made in code skip the parser's ranges: a ring of one slot read
// every unit's state into that slot (each unit then trained on the last
// unit's state), none divided by zero. Validate (Engine::Create) checks them.
TEST(SettingsTest, ValidateChecksWhatTheParserRangeChecks) {
  const auto refused = [](auto set, std::string_view said) {
    Settings s;
    set(s);
    const Status v = Validate(s);
    EXPECT_EQ(v.code(), StatusCode::kInvalidArgument) << said;
    EXPECT_NE(v.message().find(said), std::string::npos) << v;
  };
  refused([](Settings& s) { s.buffer_count = 1; }, "buffer_count 1");
  refused([](Settings& s) { s.buffer_count = 0; }, "buffer_count 0");
  refused([](Settings& s) { s.queue_depth = 0; }, "aio.queue_depth 0");
  refused([](Settings& s) { s.stripe_bytes = 1000; }, "aio.block_size 1000");
  refused([](Settings& s) { s.optimizer_threads = -1; }, "ztier.optimizer_threads -1");
  Settings ok;
  ok.buffer_count = 3;
  EXPECT_TRUE(Validate(ok).ok());
  EXPECT_EQ(Engine::Create([] {
              Settings s;
              s.buffer_count = 1;
              s.dram_budget_bytes = uint64_t{64} << 20;
              return s;
            }())
                .status()
                .code(),
            StatusCode::kInvalidArgument);
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

std::string ReadSourceFile(const std::string& relative) {
  std::ifstream in(std::string(ZTIER_SOURCE_DIR) + "/" + relative);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// docs/configuration.md is the home of the full table: the lines between its
// two markers are exactly what DescribeSettings() prints.
TEST(SettingsTest, ConfigurationDocHasTheTable) {
  const std::string doc = ReadSourceFile("docs/configuration.md");
  ASSERT_FALSE(doc.empty()) << "docs/configuration.md not found";
  const std::string begin = "\n<!-- BEGIN ztierd --describe-settings";
  const std::string end = "\n<!-- END ztierd --describe-settings";
  const size_t b = doc.find(begin);
  ASSERT_NE(b, std::string::npos) << "docs/configuration.md lacks the line starting" << begin;
  const size_t table = doc.find('\n', b + 1) + 1;
  const size_t e = doc.find(end, table - 1);
  ASSERT_NE(e, std::string::npos) << "docs/configuration.md lacks the line starting" << end;
  const std::string have = doc.substr(table, e + 1 - table);
  const std::string want = DescribeSettings();
  if (have == want) return;
  // The first line that differs, rather than both tables whole.
  std::istringstream have_lines(have), want_lines(want);
  std::string h, w;
  int line = 0;
  while (true) {
    const bool more_h = static_cast<bool>(std::getline(have_lines, h));
    const bool more_w = static_cast<bool>(std::getline(want_lines, w));
    ++line;
    if (!more_h && !more_w) break;
    if (more_h != more_w || h != w) break;
  }
  ADD_FAILURE() << "docs/configuration.md's settings table is not what DescribeSettings() "
                   "prints; its line "
                << line << " of the table:\n  " << h << "\nshould be:\n  " << w
                << "\nregenerate it: cmake --build build/release --target ztierd && "
                   "scripts/configuration_md.sh build/release/engine/ztierd";
}

// README keeps a short table of the most used settings: each of its rows is
// a row of the full table, and it links to docs/configuration.md.
TEST(SettingsTest, ReadmeSettingsAreCurrent) {
  const std::string readme = ReadSourceFile("README.md");
  ASSERT_FALSE(readme.empty()) << "README.md not found";
  const size_t start = readme.find("\n## Configuration\n");
  ASSERT_NE(start, std::string::npos) << "README.md lacks its Configuration section";
  const size_t stop = readme.find("\n## ", start + 1);
  const std::string section = readme.substr(start, stop == std::string::npos ? stop : stop - start);
  EXPECT_NE(section.find("(docs/configuration.md)"), std::string::npos)
      << "README's Configuration section should link to docs/configuration.md";
  // (Built by appending: GCC 12 warns wrongly about "\n" + std::string.)
  std::string described = "\n";
  described += DescribeSettings();
  std::istringstream lines(section);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    if (!line.starts_with("| `")) continue;
    ++rows;
    std::string row = "\n";
    row += line;
    row += "\n";
    EXPECT_NE(described.find(row), std::string::npos)
        << "README's settings row is not a row of DescribeSettings() (copy it from "
           "docs/configuration.md):\n"
        << line;
  }
  EXPECT_GT(rows, 0) << "README's Configuration section has no settings rows";
}

TEST(SettingsTest, DescriptionListsEveryEnvironmentVariable) {
  const std::string d = DescribeSettings();
  for (const char* env : {"ZTIER_DRAM_BUDGET", "ZTIER_NVME_PATHS", "ZTIER_QUEUE_DEPTH",
                          "ZTIER_STRIPE_BYTES", "ZTIER_CHECKSUMS", "ZTIER_BUFFER_COUNT"}) {
    EXPECT_NE(d.find(env), std::string::npos) << env;
  }
}

// A list with an empty item is a typo ("0.9,,0.95"), not two betas.
TEST(SettingsTest, BetasWithAnEmptyItemAreRefused) {
  for (const char* bad : {"ZTIER_BETAS=0.9,,0.95", "ZTIER_BETAS=,0.9,0.95", "ZTIER_BETAS=0.9,"}) {
    const char* env[] = {bad, nullptr};
    Result<Settings> s = ApplyEnvironment(Settings{}, env);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("is not two numbers"), std::string::npos) << s.status();
  }
  const char* good[] = {"ZTIER_BETAS=0.9,0.95", nullptr};
  Result<Settings> s = ApplyEnvironment(Settings{}, good);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s->training.beta2, 0.95);
}

TEST(SettingsTest, AMisspelledKeyOrVariableNamesTheSettingItIsClosestTo) {
  Result<Settings> key = ParseSettings(R"({"aio": {"queue_dept": 8}})", "f.json");
  ASSERT_FALSE(key.ok());
  EXPECT_NE(key.status().message().find("did you mean 'aio.queue_depth'"), std::string::npos)
      << key.status();
  Result<Settings> top = ParseSettings(R"({"gradient_clip": 1.0})", "f.json");
  ASSERT_FALSE(top.ok());
  EXPECT_NE(top.status().message().find("did you mean 'gradient_clipping'"), std::string::npos)
      << top.status();
  Result<Settings> far = ParseSettings(R"({"colour": 1})", "f.json");
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.status().message().find("did you mean"), std::string::npos) << far.status();
  Result<Settings> flag = ApplySetting(Settings(), "ZTIER_QUEUE_DEPT", "8", "--set");
  ASSERT_FALSE(flag.ok());
  EXPECT_NE(flag.status().message().find("did you mean 'ZTIER_QUEUE_DEPTH'"), std::string::npos)
      << flag.status();

  // A misspelled variable is warned of once a process; the variables that
  // are not settings (logging, tests) are not.
  const char* env[] = {"ZTIER_DRAM_BUGET=1G", "ZTIER_LOG=warn",      "ZTIER_TEST_ANYTHING=1",
                       "ZTIER_QUEUE_DEPTH=8", "ZTIER_NOT_A_THING=1", nullptr};
  ::testing::internal::CaptureStderr();
  Result<Settings> s = ApplyEnvironment(Settings(), env);
  Result<Settings> again = ApplyEnvironment(Settings(), env);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(s->dram_budget_bytes, Settings().dram_budget_bytes);
  EXPECT_NE(log.find("ZTIER_DRAM_BUGET is set but names no setting and is ignored; did you mean "
                     "'ZTIER_DRAM_BUDGET'?"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("ZTIER_NOT_A_THING is set but names no setting and is ignored"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("ZTIER_NOT_A_THING", log.find("ZTIER_NOT_A_THING") + 1), std::string::npos)
      << "warned of twice: " << log;
  EXPECT_EQ(log.find("ZTIER_LOG "), std::string::npos) << log;
  EXPECT_EQ(log.find("ZTIER_TEST_"), std::string::npos) << log;
  EXPECT_EQ(log.find("ZTIER_QUEUE_DEPTH"), std::string::npos) << log;
}

// DeepSpeed's old cpu_offload beside an offload_optimizer.device that says
// otherwise: the keys' order picked one in silence.
TEST(SettingsTest, AnOldSpellingThatContradictsItsSettingIsRefused) {
  Result<Settings> both = ParseSettings(
      R"({"zero_optimization": {"cpu_offload": true,
          "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})",
      "f.json");
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("'zero_optimization.cpu_offload' (DeepSpeed's old "
                                         "spelling) is true"),
            std::string::npos)
      << both.status();
  EXPECT_NE(both.status().message().find("'zero_optimization.offload_optimizer.device' is nvme"),
            std::string::npos)
      << both.status();
  Result<Settings> params = ParseSettings(
      R"({"zero_optimization": {"offload_param": {"device": "nvme"}, "cpu_offload_params": true}})",
      "f.json");
  EXPECT_FALSE(params.ok());
  for (
      const char* agree : {
          R"({"zero_optimization": {"cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})",
          R"({"zero_optimization": {"cpu_offload": false,
               "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})",
      }) {
    Result<Settings> s = ParseSettings(agree, "f.json");
    EXPECT_TRUE(s.ok()) << agree << ": " << s.status();
  }
}

// Two spellings of one setting with one value in two forms were refused
// as if they disagreed.
TEST(SettingsTest, TwoSpellingsOfOneValueAgree) {
  Result<Settings> live = ParseSettings(
      R"({"zero_optimization": {"stage3_max_live_parameters": "1M",
                                "max_live_parameters": 1048576}})",
      "f.json");
  ASSERT_TRUE(live.ok()) << live.status();
  Result<Settings> paths = ParseSettings(
      R"({"zero_optimization": {"offload_optimizer": {"nvme_path": "/a"},
                                "offload_param": {"nvme_path": ["/a/"]}}})",
      "f.json");
  ASSERT_TRUE(paths.ok()) << paths.status();
}

// DeepSpeed's old spellings set to false set nothing, but the file was
// named the source of the setting they stand for: ztier-train's own
// default (states in ztierd's DRAM) then did not apply, and it said
// "offload_optimizer.device = nvme (from old.json)", which the file never said.
TEST(SettingsTest, AnOldSpellingSetToFalseIsNoSourceOfItsSetting) {
  for (const char* json : {R"({"zero_optimization": {"cpu_offload": false}})",
                           R"({"zero_optimization": {"cpu_offload_param": false}})",
                           R"({"optimizer": {"params": {"amsgrad": false}}})"}) {
    Result<Settings> s = ParseSettings(json, "old.json");
    ASSERT_TRUE(s.ok()) << json << ": " << s.status();
    EXPECT_EQ(s->sources.count("zero_optimization.offload_optimizer.device"), 0u) << json;
    EXPECT_EQ(s->sources.count("zero_optimization.offload_param.device"), 0u) << json;
    EXPECT_EQ(s->sources.count("optimizer.type"), 0u) << json;
  }
  // Nor through ApplySetting (a Python settings= dict) or its spellings.
  for (const char* off : {"false", "False", "0"}) {
    Result<Settings> set = ApplySetting(Settings(), "zero_optimization.cpu_offload", off, "dict");
    if (!set.ok()) continue;  // a spelling ParseBool refuses
    EXPECT_EQ(set->sources.count("zero_optimization.offload_optimizer.device"), 0u) << off;
  }
  Result<Settings> on =
      ParseSettings(R"({"zero_optimization": {"cpu_offload": true}})", "new.json");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->sources.at("zero_optimization.offload_optimizer.device"), "new.json");
}

// Booleans are taken in any case, as sizes' suffixes are: "TRUE" was
// refused where "1gb" was taken (and Python's str(False) is "False").
TEST(SettingsTest, BooleansAreTakenInAnyCase) {
  for (const auto& [text, want] : {std::pair<const char*, bool>{"FALSE", false},
                                   {"False", false},
                                   {"Off", false},
                                   {"TRUE", true},
                                   {"Yes", true}}) {
    Settings start;
    start.checksums = !want;
    Result<Settings> set = ApplySetting(start, "ztier.checksums", text, "env");
    ASSERT_TRUE(set.ok()) << text << ": " << set.status();
    EXPECT_EQ(set->checksums, want) << text;
  }
  Result<Settings> bad = ApplySetting(Settings(), "ztier.checksums", "maybe", "env");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("is not a boolean"), std::string::npos) << bad.status();
}

// What follows a NUL byte was dropped (the parser ends its input there), and
// two top-level objects got a comma between them in the error, which the
// user never wrote.
TEST(SettingsTest, ANulByteOrASecondTopLevelValueIsNamedAsSuch) {
  const std::string nul = std::string(R"({"ztier": {"dram_budget": "1G"}})") + '\0' + "garbage";
  Result<Settings> a = ParseSettings(nul, "nul.json");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("nul.json: a NUL byte at line 1, column 33"),
            std::string::npos)
      << a.status();
  Result<Settings> b =
      ParseSettings("{\"aio\": {\"queue_depth\": 8}}\n{\"aio\": {}}\n", "two.json");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message().find("','"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("line 2"), std::string::npos) << b.status();
  // A line break between members still separates them (hjson, as DeepSpeed reads).
  Result<Settings> c =
      ParseSettings("{\"aio\": {\"queue_depth\": 8\n\"block_size\": \"1M\"}}", "c.json");
  EXPECT_TRUE(c.ok()) << c.status();
}

}  // namespace
}  // namespace ztier::engine
