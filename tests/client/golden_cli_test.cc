// attnserve-client infer on PyTorch's golden fixtures: the weights loaded into a real server with
// --model, the fixture's input sent from a .npy file, the output file compared with what PyTorch
// computed. Checks the whole path a user takes, files and flags included.
#include <cmath>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/npy.h"
#include "gtest/gtest.h"
#include "tests/client/process.h"
#include "tests/common/golden.h"
#include "tests/common/temp_dir.h"

namespace attnserve::test {
namespace {

using client::FloatArray;

constexpr float kTolerance = 1e-4f;

// The cases sent through the command line: every kind, and every --model option (a prefix, a
// num_heads for a file without metadata, a d_context that differs from d_model).
const std::vector<std::string> kCases = {
    "torch_mha/bidirectional",  "torch_mha/causal", "torch_mha/cross",
    "torch_mha/causal_cross",   "query_kv/cross",   "prefixed/causal",
    "no_metadata/causal_cross",
};

// The model name a case's weights are served under: the weights file's stem.
std::string ModelName(const GoldenCase& c) {
  std::string name = c.weights_path.substr(c.weights_path.rfind('/') + 1);
  return name.substr(0, name.find('.'));
}

// The server's --model flag that loads a case's weights as the fixture says to.
std::string ModelFlag(const GoldenCase& c) {
  std::string flag = absl::StrCat(ModelName(c), "=", c.weights_path);
  if (c.load_options.num_heads) absl::StrAppend(&flag, ":num_heads=", *c.load_options.num_heads);
  if (!c.load_options.prefix.empty()) absl::StrAppend(&flag, ":prefix=", c.load_options.prefix);
  return flag;
}

std::string KindFlag(core::AttentionKind kind) {
  switch (kind) {
    case core::AttentionKind::kBidirectional:
      return "bidirectional";
    case core::AttentionKind::kCausal:
      return "causal";
    case core::AttentionKind::kCross:
      return "cross";
    case core::AttentionKind::kCausalCross:
      return "causal_cross";
  }
  return "";
}

FloatArray ToArray(const GoldenBatch& batch) {
  return {.shape = {batch.batch, batch.seq_len, batch.width}, .values = batch.values};
}

class GoldenCliTest : public ::testing::TestWithParam<bool> {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::vector<GoldenCase>> all = LoadGoldenCases();
    ASSERT_TRUE(all.ok()) << all.status();
    std::map<std::string, std::string> flags;  // model name -> --model flag, once per file
    for (GoldenCase& c : *all) {
      if (std::find(kCases.begin(), kCases.end(), c.name) == kCases.end()) continue;
      flags[ModelName(c)] = ModelFlag(c);
      cases_.push_back(std::move(c));
    }
    ASSERT_EQ(cases_.size(), kCases.size());
    std::vector<std::string> args = {"--threads", "2"};
    for (const auto& [name, flag] : flags) args.insert(args.end(), {"--model", flag});
    absl::StatusOr<std::unique_ptr<ServerProcess>> started =
        ServerProcess::Start(ATTNSERVE_SERVER_BIN, args);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    cases_.clear();
  }

  static ServerProcess* server_;
  static std::vector<GoldenCase> cases_;
};
ServerProcess* GoldenCliTest::server_ = nullptr;
std::vector<GoldenCase> GoldenCliTest::cases_;

// Writes the case's arrays, runs infer, and returns the output file's array.
FloatArray InferThroughCli(const std::string& target, const GoldenCase& c, bool packed) {
  const std::string dir = MakeTempDir("client");
  const std::string in = dir + "/in.npy", ctx = dir + "/ctx.npy", out = dir + "/out.npy";
  EXPECT_TRUE(client::WriteNpy(in, ToArray(c.input)).ok());
  std::vector<std::string> argv = {ATTNSERVE_CLIENT_BIN,
                                   "--target",
                                   target,
                                   "infer",
                                   "--model",
                                   ModelName(c),
                                   "--kind",
                                   KindFlag(c.kind),
                                   "--input",
                                   in,
                                   "--lengths",
                                   absl::StrJoin(c.input.lengths, ","),
                                   "--output",
                                   out};
  if (c.context) {
    EXPECT_TRUE(client::WriteNpy(ctx, ToArray(*c.context)).ok());
    argv.insert(argv.end(),
                {"--context", ctx, "--context-lengths", absl::StrJoin(c.context->lengths, ",")});
  }
  if (packed) argv.push_back("--packed");
  ProgramResult r = RunProgram(argv);
  EXPECT_EQ(r.exit_code, 0) << c.name << "\n" << r.out << r.err;
  absl::StatusOr<FloatArray> output = client::ReadNpy(out);
  EXPECT_TRUE(output.ok()) << c.name << ": " << output.status();
  return output.ok() ? *std::move(output) : FloatArray{};
}

TEST_P(GoldenCliTest, OutputFileMatchesPyTorch) {
  ASSERT_NE(server_, nullptr);
  for (const GoldenCase& c : cases_) {
    FloatArray output = InferThroughCli(server_->target(), c, /*packed=*/GetParam());
    ASSERT_EQ(output.shape, (std::vector<int64_t>{c.input.batch, c.input.seq_len, c.d_output}))
        << c.name;
    float worst = 0;
    for (size_t i = 0; i < c.output_rows.size(); ++i) {
      for (int64_t j = 0; j < c.d_output; ++j) {
        const float got = output.values[c.output_rows[i] * c.d_output + j];
        worst = std::max(worst, std::fabs(got - c.expected_output[i * c.d_output + j]));
      }
    }
    EXPECT_LE(worst, kTolerance) << c.name << (GetParam() ? " packed" : " padded");
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GoldenCliTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Packed" : "Padded"; });

}  // namespace
}  // namespace attnserve::test
