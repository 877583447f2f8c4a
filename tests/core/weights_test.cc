// Tests of the layout loader (LoadLayerWeights), CheckWeights, the demo layer, and loading under
// a memory limit. Good files are the committed fixtures (written by PyTorch); bad ones are built
// here in a temp dir.
#include "core/weights.h"

#include <sys/resource.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/layer.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "tests/common/golden.h"
#include "tests/common/safetensors_writer.h"
#include "tests/common/temp_dir.h"

namespace attnserve::core {
namespace {

using test::MakeSafetensors;
using test::PatternTensor;
using test::TensorToWrite;

std::string Fixture(const std::string& name) { return test::FixturesDir() + "/" + name; }

// ------------------------------------------------------------------ every layout loads

struct LayoutExpectation {
  std::string file;
  LoadOptions options;
  WeightLayout layout;
  int64_t d_model, d_context, num_heads, head_dim;
  bool has_bias, has_output_projection;
};

TEST(LoadLayerWeightsTest, LoadsEveryLayoutOfTheFixtures) {
  const LoadOptions none;
  const std::vector<LayoutExpectation> expectations = {
      {"w_separate.safetensors", none, WeightLayout::kSeparate, 16, 16, 1, 16, false, false},
      {"w_separate_bias.safetensors", none, WeightLayout::kSeparate, 16, 16, 1, 16, true, false},
      {"w_query_key_value.safetensors", none, WeightLayout::kQueryKeyValue, 16, 16, 1, 16, true,
       false},
      {"w_fused_mh.safetensors", none, WeightLayout::kFusedQkv, 16, 16, 4, 4, true, true},
      {"w_fused_inner.safetensors", none, WeightLayout::kFusedQkv, 16, 16, 2, 12, true, true},
      {"w_fused_single.safetensors", none, WeightLayout::kFusedQkv, 32, 32, 1, 8, true, true},
      {"w_fused_nobias.safetensors", none, WeightLayout::kFusedQkv, 16, 16, 2, 8, false, true},
      {"w_query_kv.safetensors", none, WeightLayout::kQueryKv, 16, 12, 2, 8, true, true},
      {"w_query_kv_self.safetensors", none, WeightLayout::kQueryKv, 16, 16, 2, 8, true, true},
      {"w_torch_mha.safetensors", none, WeightLayout::kTorchMha, 16, 16, 4, 4, true, true},
      {"w_fused_f16.safetensors", none, WeightLayout::kFusedQkv, 16, 16, 4, 4, true, true},
      {"w_torch_bf16.safetensors", none, WeightLayout::kTorchMha, 16, 16, 4, 4, true, true},
      {"w_prefixed.safetensors",
       {std::nullopt, "encoder.layers.0.self_attn."},
       WeightLayout::kTorchMha,
       16,
       16,
       2,
       8,
       true,
       true},
      {"w_no_metadata.safetensors", {4, ""}, WeightLayout::kFusedQkv, 16, 16, 4, 4, true, true},
      {"w_kernel_h2.safetensors", none, WeightLayout::kFusedQkv, 32, 32, 2, 64, true, true},
  };
  for (const LayoutExpectation& e : expectations) {
    SCOPED_TRACE(e.file);
    absl::StatusOr<LayerWeights> w = LoadLayerWeights(Fixture(e.file), e.options);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->spec.layout, e.layout);
    EXPECT_EQ(w->spec.d_model, e.d_model);
    EXPECT_EQ(w->spec.d_context, e.d_context);
    EXPECT_EQ(w->spec.num_heads, e.num_heads);
    EXPECT_EQ(w->spec.head_dim, e.head_dim);
    EXPECT_EQ(w->spec.has_bias, e.has_bias);
    EXPECT_EQ(w->spec.has_output_projection, e.has_output_projection);
    EXPECT_TRUE(CheckWeights(*w).ok());
  }
}

// The fused tensor's rows are q, k, v in that order (PyTorch's convention), bias likewise.
TEST(LoadLayerWeightsTest, SplitsFusedProjectionsInQkvOrder) {
  const std::string path = Fixture("w_torch_mha.safetensors");
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<LayerWeights> w = LoadLayerWeights(path, {});
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<float>& in_proj = file->tensors.at("in_proj_weight").values;
  const std::vector<float>& in_bias = file->tensors.at("in_proj_bias").values;
  const size_t block = 16 * 16;
  EXPECT_EQ(w->w_q, std::vector<float>(in_proj.begin(), in_proj.begin() + block));
  EXPECT_EQ(w->w_k, std::vector<float>(in_proj.begin() + block, in_proj.begin() + 2 * block));
  EXPECT_EQ(w->w_v, std::vector<float>(in_proj.begin() + 2 * block, in_proj.end()));
  EXPECT_EQ(w->b_v, std::vector<float>(in_bias.begin() + 32, in_bias.end()));
  EXPECT_EQ(w->w_o, file->tensors.at("out_proj.weight").values);
}

TEST(LoadLayerWeightsTest, OptionNumHeadsWinsOverMetadata) {
  absl::StatusOr<LayerWeights> w = LoadLayerWeights(Fixture("w_fused_mh.safetensors"), {2, ""});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->spec.num_heads, 2);
  EXPECT_EQ(w->spec.head_dim, 8);
}

TEST(LoadLayerWeightsTest, F16AndBF16FilesLoadTheStoredValues) {
  const std::string f16_path = Fixture("w_fused_f16.safetensors");
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(f16_path);
  ASSERT_TRUE(file.ok()) << file.status();
  const StoredTensor& wqkv = file->tensors.at("Wqkv.weight");
  EXPECT_EQ(wqkv.dtype, "F16");
  absl::StatusOr<LayerWeights> w = LoadLayerWeights(f16_path, {});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->w_q, std::vector<float>(wqkv.values.begin(), wqkv.values.begin() + 16 * 16));
  absl::StatusOr<LayerWeights> b = LoadLayerWeights(Fixture("w_torch_bf16.safetensors"), {});
  ASSERT_TRUE(b.ok()) << b.status();
  for (float x : b->w_o) {
    ASSERT_EQ(std::bit_cast<uint32_t>(x) & 0xffff, 0u) << x;  // exactly a bf16 value
  }
}

// ------------------------------------------------------------------ refusals

class LoadRefusalTest : public testing::Test {
 protected:
  // Writes `tensors` (with __metadata__ num_heads unless `num_heads` is empty) and loads it.
  absl::StatusOr<LayerWeights> Load(const std::vector<TensorToWrite>& tensors,
                                    const std::string& num_heads = "2",
                                    const LoadOptions& options = {}) {
    std::map<std::string, std::string> metadata;
    if (!num_heads.empty()) metadata["num_heads"] = num_heads;
    test::WriteSafetensorsFile(path_, MakeSafetensors(tensors, metadata));
    return LoadLayerWeights(path_, options);
  }

  absl::StatusCode Code(const std::vector<TensorToWrite>& tensors,
                        const std::string& num_heads = "2", const LoadOptions& options = {}) {
    return Load(tensors, num_heads, options).status().code();
  }

  // A good fused layer: d_model 8, inner 8, with biases.
  static std::vector<TensorToWrite> Fused() {
    return {PatternTensor("Wqkv.weight", {24, 8}, 1), PatternTensor("Wqkv.bias", {24}, 2),
            PatternTensor("Wo.weight", {8, 8}, 3), PatternTensor("Wo.bias", {8}, 4)};
  }

  static std::vector<TensorToWrite> Without(std::vector<TensorToWrite> tensors,
                                            const std::string& name) {
    std::erase_if(tensors, [&](const TensorToWrite& t) { return t.name == name; });
    return tensors;
  }

  static std::vector<TensorToWrite> With(std::vector<TensorToWrite> tensors, TensorToWrite t) {
    tensors = Without(std::move(tensors), t.name);
    tensors.push_back(std::move(t));
    return tensors;
  }

  const std::string path_ = test::MakeTempDir("weights") + "/layer.safetensors";
};

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

TEST_F(LoadRefusalTest, TheGoodFileLoads) {
  absl::StatusOr<LayerWeights> w = Load(Fused());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->spec.head_dim, 4);
}

TEST_F(LoadRefusalTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadLayerWeights(path_ + ".absent", {}).status().code(), absl::StatusCode::kNotFound);
}

// What --model NAME=PATH prints at start-up: the system's reason, not "no such file".
TEST_F(LoadRefusalTest, AnUnreachableFileSaysWhy) {
  const std::string loop = path_ + ".loop";
  std::filesystem::create_symlink(loop, loop);
  const absl::Status status = LoadLayerWeights(loop, {}).status();
  EXPECT_EQ(status.code(), kInvalid) << status;
  EXPECT_NE(status.message().find(loop + ": cannot open the file: too many levels of symbolic"),
            std::string::npos)
      << status;
}

TEST_F(LoadRefusalTest, NotSafetensorsIsInvalid) {
  test::WriteBytes(path_, "this is not a safetensors file at all");
  EXPECT_EQ(LoadLayerWeights(path_, {}).status().code(), kInvalid);
}

TEST_F(LoadRefusalTest, RefusesMissingTensors) {
  for (const char* name : {"Wo.weight", "Wqkv.weight"}) {
    absl::StatusOr<LayerWeights> w = Load(Without(Fused(), name));
    EXPECT_EQ(w.status().code(), kInvalid) << name;
    EXPECT_NE(w.status().message().find(name), std::string::npos) << w.status();
    EXPECT_NE(w.status().message().find(path_), std::string::npos) << w.status();
  }
  const std::vector<TensorToWrite> separate = {PatternTensor("W_q.weight", {8, 8}),
                                               PatternTensor("W_k.weight", {8, 8})};
  EXPECT_EQ(Code(separate, "1"), kInvalid);
  EXPECT_EQ(Code({PatternTensor("Wq.weight", {8, 8}), PatternTensor("Wo.weight", {8, 8})}),
            kInvalid);
}

TEST_F(LoadRefusalTest, RefusesBiasesThatComeAndGo) {
  EXPECT_EQ(Code(Without(Fused(), "Wo.bias")), kInvalid);
  EXPECT_EQ(Code(Without(Fused(), "Wqkv.bias")), kInvalid);
  const std::vector<TensorToWrite> separate = {
      PatternTensor("W_q.weight", {8, 8}), PatternTensor("W_q.bias", {8}),
      PatternTensor("W_k.weight", {8, 8}), PatternTensor("W_v.weight", {8, 8})};
  EXPECT_EQ(Code(separate, "1"), kInvalid);
}

TEST_F(LoadRefusalTest, RefusesUnexpectedTensors) {
  absl::StatusOr<LayerWeights> w = Load(With(Fused(), PatternTensor("Wx.weight", {8, 8})));
  EXPECT_EQ(w.status().code(), kInvalid);
  EXPECT_NE(w.status().message().find("Wx.weight"), std::string::npos) << w.status();
  // Two layouts in one file: the second's tensors are unexpected in the first.
  EXPECT_EQ(Code(With(Fused(), PatternTensor("in_proj_weight", {24, 8}))), kInvalid);
  // torch's add_bias_kv adds tensors we do not implement: refused, not ignored.
  const std::vector<TensorToWrite> torch = {
      PatternTensor("in_proj_weight", {24, 8}), PatternTensor("in_proj_bias", {24}),
      PatternTensor("out_proj.weight", {8, 8}), PatternTensor("out_proj.bias", {8}),
      PatternTensor("bias_k", {1, 1, 8})};
  EXPECT_EQ(Code(torch), kInvalid);
}

// A file refused for its structure (a stray tensor) is refused from its header, none of its data
// read: a sparse file declaring a gigabyte it holds as a hole costs no memory.
TEST_F(LoadRefusalTest, AStrayTensorIsRefusedBeforeAnyDataIsRead) {
  constexpr int64_t kJunkBytes = int64_t{1} << 30;
  test::SafetensorsParts parts = MakeSafetensors(Fused(), {{"num_heads", "2"}});
  const size_t layer_bytes = parts.data.size();
  parts.header.pop_back();  // the closing brace
  parts.header +=
      absl::StrCat(",\"junk\":{\"dtype\":\"F32\",\"shape\":[", kJunkBytes / 4,
                   "],\"data_offsets\":[", layer_bytes, ",", layer_bytes + kJunkBytes, "]}}");
  test::WriteSafetensorsFile(path_, parts);
  std::filesystem::resize_file(path_, 8 + parts.header.size() + layer_bytes + kJunkBytes);
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  const absl::Status status = LoadLayerWeights(path_, {}).status();
  getrusage(RUSAGE_SELF, &after);
  EXPECT_EQ(status.code(), kInvalid) << status;
  EXPECT_NE(status.message().find("'junk' is unexpected"), std::string::npos) << status;
  // ru_maxrss is in KiB; reading the tensor would take 2 GiB (its bytes and their floats).
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 << 10)
      << "peak RSS grew by " << (after.ru_maxrss - before.ru_maxrss) / 1024 << " MiB";
}

TEST_F(LoadRefusalTest, RefusesShapesThatDisagree) {
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wqkv.weight", {23, 8}))), kInvalid);  // not 3 parts
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wo.weight", {8, 6}))), kInvalid);
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wo.weight", {6, 8}))), kInvalid);
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wqkv.bias", {8}))), kInvalid);
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wo.bias", {8, 1}))), kInvalid);
  EXPECT_EQ(Code(With(Fused(), PatternTensor("Wqkv.weight", {24, 8, 1}))), kInvalid);
  absl::StatusOr<LayerWeights> empty = Load(With(Fused(), PatternTensor("Wqkv.weight", {24, 0})));
  EXPECT_EQ(empty.status().code(), kInvalid);
  EXPECT_NE(empty.status().message().find("'Wqkv.weight' has no columns"), std::string::npos)
      << empty.status();
  const std::vector<TensorToWrite> separate = {PatternTensor("W_q.weight", {8, 8}),
                                               PatternTensor("W_k.weight", {6, 8}),
                                               PatternTensor("W_v.weight", {8, 8})};
  EXPECT_EQ(Code(separate, "1"), kInvalid);
  const std::vector<TensorToWrite> kv_reads_differently = {PatternTensor("W_q.weight", {8, 8}),
                                                           PatternTensor("W_k.weight", {8, 8}),
                                                           PatternTensor("W_v.weight", {8, 5})};
  EXPECT_EQ(Code(kv_reads_differently, "1"), kInvalid);
  const std::vector<TensorToWrite> query_kv = {PatternTensor("Wq.weight", {8, 8}),
                                               PatternTensor("Wkv.weight", {15, 6}),
                                               PatternTensor("Wo.weight", {8, 8})};
  EXPECT_EQ(Code(query_kv), kInvalid);
}

TEST_F(LoadRefusalTest, RefusesBadNumHeads) {
  EXPECT_EQ(Code(Fused(), "3"), kInvalid);  // does not divide 8
  EXPECT_EQ(Code(Fused(), "0"), kInvalid);
  EXPECT_EQ(Code(Fused(), "-2"), kInvalid);
  EXPECT_EQ(Code(Fused(), "two"), kInvalid);
  EXPECT_EQ(Code(Fused(), "99999999999999999999"), kInvalid);
  EXPECT_EQ(Code(Fused(), ""), kInvalid);            // no metadata, no option
  EXPECT_EQ(Code(Fused(), "2", {5, ""}), kInvalid);  // the option wins, and is wrong
  EXPECT_EQ(Code(Fused(), "", {-1, ""}), kInvalid);
  absl::StatusOr<LayerWeights> w = Load(Fused(), "", {4, ""});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->spec.head_dim, 2);
}

TEST_F(LoadRefusalTest, RefusesUnknownLayouts) {
  EXPECT_EQ(Code({PatternTensor("foo.weight", {8, 8})}), kInvalid);
  EXPECT_EQ(Code({PatternTensor("Wo.weight", {8, 8})}), kInvalid);
  EXPECT_EQ(Code({}), kInvalid);
}

// A file of a thousand tensors or with a megabyte-long name is refused in a message of a line or
// two: it lists a few names, clipped, not all of them.
TEST_F(LoadRefusalTest, RefusalMessagesStayShort) {
  std::vector<TensorToWrite> unknown;
  for (int i = 0; i < 1000; ++i) {
    unknown.push_back(PatternTensor(absl::StrCat("model.block_", i, ".mlp.weight"), {1}));
  }
  absl::StatusOr<LayerWeights> w = Load(unknown);
  EXPECT_EQ(w.status().code(), kInvalid);
  EXPECT_NE(w.status().message().find("model.block_0.mlp.weight"), std::string::npos);
  EXPECT_NE(w.status().message().find("992 more"), std::string::npos) << w.status();
  EXPECT_LT(w.status().message().size(), 1000u) << w.status();

  const std::string long_name = "Wx" + std::string(1'000'000, 'x');
  absl::StatusOr<LayerWeights> named = Load(With(Fused(), PatternTensor(long_name, {1})));
  EXPECT_EQ(named.status().code(), kInvalid);
  EXPECT_NE(named.status().message().find("'Wxxx"), std::string::npos);
  EXPECT_LT(named.status().message().size(), 400u) << named.status().message().substr(0, 400);
  EXPECT_LT(Load(Fused(), std::string(1'000'000, '7') + "x").status().message().size(), 400u);
}

TEST_F(LoadRefusalTest, RefusesNonFiniteWeights) {
  TensorToWrite wo = PatternTensor("Wo.weight", {8, 8});
  wo.values[5] = NAN;
  absl::StatusOr<LayerWeights> w = Load(With(Fused(), wo));
  EXPECT_EQ(w.status().code(), kInvalid);
  EXPECT_NE(w.status().message().find("'Wo.weight' has a non-finite value at index 5"),
            std::string::npos)
      << w.status();
  wo.values[5] = INFINITY;
  EXPECT_EQ(Code(With(Fused(), wo)), kInvalid);
}

TEST_F(LoadRefusalTest, PrefixSelectsTheLayerAndIgnoresTheRestOfTheModel) {
  std::vector<TensorToWrite> model;
  for (TensorToWrite t : Fused()) {
    t.name = "decoder.attn." + t.name;
    model.push_back(t);
  }
  model.push_back(PatternTensor("decoder.mlp.weight", {4, 8}));
  TensorToWrite ids;  // a dtype we do not read, outside the prefix: ignored
  ids.name = "embeddings.position_ids";
  ids.dtype = "I64";
  ids.shape = {1};
  ids.raw = std::string(8, '\0');
  model.push_back(ids);
  absl::StatusOr<LayerWeights> w = Load(model, "2", {std::nullopt, "decoder.attn."});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->spec.layout, WeightLayout::kFusedQkv);
  // No prefix: the names are not a layout's.
  EXPECT_EQ(Code(model), kInvalid);
  // A prefix under which nothing lives; a long one is clipped in the message, as names are.
  EXPECT_EQ(Code(model, "2", {std::nullopt, "encoder."}), kInvalid);
  const absl::Status long_prefix =
      Load(model, "2", {std::nullopt, std::string(100000, 'x')}).status();
  EXPECT_EQ(long_prefix.code(), kInvalid);
  EXPECT_LT(long_prefix.message().size(), 1000u) << long_prefix.message().substr(0, 300);
  // A tensor under the prefix that the layout does not use is refused, naming it in full.
  model.push_back(PatternTensor("decoder.attn.extra", {2}));
  absl::StatusOr<LayerWeights> bad = Load(model, "2", {std::nullopt, "decoder.attn."});
  EXPECT_EQ(bad.status().code(), kInvalid);
  EXPECT_NE(bad.status().message().find("decoder.attn.extra"), std::string::npos) << bad.status();
}

// ------------------------------------------------------------------ CheckWeights and the demo

TEST(DemoWeightsTest, HasTheAdvertisedShapeAndPassesItsOwnCheck) {
  const LayerWeights demo = MakeDemoWeights();
  EXPECT_EQ(demo.spec.d_model, 256);
  EXPECT_EQ(demo.spec.d_context, 256);
  EXPECT_EQ(demo.spec.num_heads, 4);
  EXPECT_EQ(demo.spec.head_dim, 64);
  EXPECT_TRUE(demo.spec.has_bias);
  EXPECT_TRUE(demo.spec.has_output_projection);
  EXPECT_EQ(demo.spec.layout, WeightLayout::kBuiltIn);
  EXPECT_TRUE(CheckWeights(demo).ok()) << CheckWeights(demo);
}

TEST(DemoWeightsTest, IsDeterministicAndInNnLinearInitRange) {
  const LayerWeights a = MakeDemoWeights();
  const LayerWeights b = MakeDemoWeights();
  EXPECT_EQ(a.w_q, b.w_q);
  EXPECT_EQ(a.b_o, b.b_o);
  const float bound = 1.0f / 16.0f;  // 1/sqrt(256)
  float largest = 0.0f;
  for (float x : a.w_q) largest = std::max(largest, std::fabs(x));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.9f * bound);  // spread over the range, not all zero
  EXPECT_NE(a.w_q, a.w_k);
}

TEST(CheckWeightsTest, RefusesWrongSizesAndNonFiniteValues) {
  LayerWeights w = MakeDemoWeights();
  w.w_k.pop_back();
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);

  w = MakeDemoWeights();
  w.b_v.clear();  // has_bias says it must be there
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);

  w = MakeDemoWeights();
  w.w_o[3] = std::nanf("");
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);

  w = MakeDemoWeights();
  w.spec.num_heads = 0;
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);

  w = MakeDemoWeights();
  w.spec.d_model = int64_t{1} << 40;  // refused before any size product can overflow
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);

  w = MakeDemoWeights();
  w.spec.has_output_projection = false;  // then w_o must be empty
  EXPECT_EQ(CheckWeights(w).code(), kInvalid);
}

// ------------------------------------------------------------------ out of memory

// Caps the process's address space at what it maps now plus `headroom_mib`.
void LimitAddressSpace(int64_t headroom_mib) {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0;
  statm >> pages;
  const rlim_t bytes = static_cast<rlim_t>(pages * sysconf(_SC_PAGESIZE) + (headroom_mib << 20));
  const rlimit limit{bytes, bytes};
  if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(3);
}

// Loading a 16 MiB layer and preparing it for bf16 under a memory limit that every step of the
// way can exhaust: each failed allocation comes back as ResourceExhausted, none ends the process.
TEST(OutOfMemoryTest, LoadingAndPreparingALayerAnswerWithAStatus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // gtest's threadsafe style runs this test again in each child, so each child makes its own
  // directory and removes it before _Exit (which runs no destructors).
  const std::string dir = test::MakeTempDir("oom"), path = dir + "/big.safetensors";
  const auto exit_with = [&dir](int code) {
    std::error_code ignored;
    try {
      std::filesystem::remove_all(dir, ignored);
    } catch (...) {  // out of memory under the limit: the directory stays, the code stands
    }
    std::_Exit(code);
  };
  test::WriteSafetensorsFile(path, MakeSafetensors({PatternTensor("Wqkv.weight", {3072, 1024}),
                                                    PatternTensor("Wo.weight", {1024, 1024})},
                                                   {{"num_heads", "8"}}));
  for (int64_t headroom_mib : {4, 16, 28, 40, 52, 64, 76, 88, 100, 160, 400}) {
    EXPECT_EXIT(
        {
          LimitAddressSpace(headroom_mib);
          const auto answered = [](const absl::Status& s) {
            return s.ok() || s.code() == absl::StatusCode::kResourceExhausted;
          };
          absl::StatusOr<LayerWeights> w = LoadLayerWeights(path, {});
          if (!w.ok()) exit_with(answered(w.status()) ? 0 : 1);
          exit_with(answered(Layer::Create(*std::move(w), Precision::kBF16).status()) ? 0 : 2);
        },
        testing::ExitedWithCode(0), "")
        << headroom_mib << " MiB of headroom";
  }
}

}  // namespace
}  // namespace attnserve::core
