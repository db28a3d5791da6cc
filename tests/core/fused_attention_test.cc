// The fused kernel against the double-precision reference: random shapes that
// straddle the tile boundaries (query blocks of up to 256 rows per kv-head
// group, bands of 64 queries under causality, key blocks of 256), every option
// the fused path serves, both precisions, one and two threads (two threads with
// few tiles split the keys), on the AVX-512 code and on the portable fallback;
// the unfused path runs the same draws. A failure prints the seed that
// reproduces it:
//   ATTNSERVE_FUSED_SEED=<seed> build/tests/fused_attention_test
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "core/sdpa_shape.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kLseBf16;
using ::attnserve::testing::kLseF32;
using ::attnserve::testing::kOutputBf16;
using ::attnserve::testing::kOutputF32;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceMask;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceShape;
using ::attnserve::testing::SdpaShape;

constexpr int kDraws = 120;
// Keeps the reference (B·H·Lq·Lk·(Dk + Dv) multiply-adds in double) quick.
constexpr double kMaxReferenceWork = 6e6;

struct Variant {
  const char* name;
  AttentionKernel kernel;
  bool portable;
  int threads;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

std::unique_ptr<AttentionEngine> MakeEngine(const Variant& v) {
  EngineOptions options;
  options.kernel = v.kernel;
  options.portable_kernels = v.portable;
  options.num_threads = v.threads;
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine =
      AttentionEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

template <typename T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> choices) {
  std::uniform_int_distribution<size_t> index(0, choices.size() - 1);
  return *(choices.begin() + index(rng));
}

bool Chance(std::mt19937_64& rng, double p) {
  return std::uniform_real_distribution<double>(0, 1)(rng) < p;
}

// One random call: shape, engine options and the reference's view of them.
struct Draw {
  AttentionShape shape;
  ReferenceShape ref_shape;
  AttentionOptions options;
  ReferenceOptions reference;
  std::vector<int64_t> key_lengths;
  std::vector<uint8_t> allowed;
  std::vector<float> bias;
  std::vector<float> alibi_slopes;
  std::vector<float> query, key, value;
  std::string description;
};

// The variants modern models use (a window, sinks, ALiBi, a softcap), each
// drawn with its own chance after the draw's other options.
void DrawVariants(std::mt19937_64& rng, Draw& d) {
  AttentionOptions& o = d.options;
  ReferenceOptions& ref = d.reference;
  if (!o.causal && Chance(rng, 0.5)) {
    // The alignment places windows and ALiBi's distances without causality.
    ref.bottom_right = true;
    o.causal_alignment = CausalAlignment::kBottomRight;
  }
  if (Chance(rng, 0.35)) {
    o.window_left = ref.window_left =
        Pick<int64_t>(rng, {-1, 0, 1, 5, 63, 64, 200, 300});
    o.window_right = ref.window_right = Pick<int64_t>(rng, {-1, -1, 0, 3, 70});
  }
  if (Chance(rng, 0.25)) {
    o.num_sink_tokens = ref.num_sink_tokens = Pick<int64_t>(rng, {1, 4, 70});
  }
  if (Chance(rng, 0.25)) {
    // ALiBi's geometric slopes 2^(−8(h+1)/H), now and then one negative.
    for (int64_t h = 0; h < d.shape.heads; ++h) {
      const double slope =
          std::pow(2.0, -8.0 * static_cast<double>(h + 1) /
                            static_cast<double>(d.shape.heads));
      d.alibi_slopes.push_back(
          static_cast<float>(Chance(rng, 0.1) ? -slope : slope));
      ref.alibi_slopes.push_back(d.alibi_slopes.back());
    }
    o.alibi_slopes = d.alibi_slopes;
  }
  if (Chance(rng, 0.25)) {
    o.softcap = Pick<float>(rng, {0.5f, 5.0f, 30.0f});
    ref.softcap = *o.softcap;
  }
}

Draw MakeDraw(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Draw d;
  AttentionShape& s = d.shape;
  do {
    s.batch = Pick<int64_t>(rng, {1, 1, 2, 3});
    s.kv_heads = Pick<int64_t>(rng, {1, 1, 2});
    s.heads = s.kv_heads * Pick<int64_t>(rng, {1, 1, 2, 3, 4, 8});
    s.query_len = Pick<int64_t>(rng, {1, 1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 32,
                                      33, 63, 64, 65, 130, 257});
    s.key_len = Pick<int64_t>(
        rng, {1, 2, 7, 63, 64, 65, 255, 256, 257, 511, 512, 513, 769});
    s.key_dim = Pick<int64_t>(rng, {1, 3, 16, 33, 64, 80, 128});
    s.value_dim = Pick<int64_t>(rng, {1, 4, 17, 64, 128});
  } while (static_cast<double>(s.batch * s.heads) * s.query_len * s.key_len *
               (s.key_dim + s.value_dim) >
           kMaxReferenceWork);
  d.ref_shape = {s.batch,   s.heads,   s.kv_heads, s.query_len,
                 s.key_len, s.key_dim, s.value_dim};
  d.query = RandomValues(s.QueryElements(), seed * 3 + 1);
  d.key = RandomValues(s.KeyElements(), seed * 3 + 2);
  d.value = RandomValues(s.ValueElements(), seed * 3 + 3);

  AttentionOptions& o = d.options;
  ReferenceOptions& ref = d.reference;
  if (Chance(rng, 0.3)) {
    o.scale = std::uniform_real_distribution<float>(0.25f, 2.0f)(rng) /
              std::sqrt(static_cast<float>(s.key_dim));
    ref.scale = *o.scale;
  }
  if (Chance(rng, 0.45)) {
    o.causal = ref.causal = true;
    ref.bottom_right = Chance(rng, 0.5);
    o.causal_alignment = ref.bottom_right ? CausalAlignment::kBottomRight
                                          : CausalAlignment::kTopLeft;
  }
  if (Chance(rng, 0.35)) {
    for (int64_t b = 0; b < s.batch; ++b) {
      d.key_lengths.push_back(
          std::uniform_int_distribution<int64_t>(0, s.key_len)(rng));
    }
    ref.key_lengths = d.key_lengths;
  }
  if (Chance(rng, 0.35)) {
    std::array<int64_t, 4> dims = {
        Chance(rng, 0.5) ? s.batch : 1, Chance(rng, 0.5) ? s.heads : 1,
        Chance(rng, 0.6) ? s.query_len : 1, Chance(rng, 0.8) ? s.key_len : 1};
    int64_t count = dims[0] * dims[1] * dims[2] * dims[3];
    ReferenceMask mask;
    mask.shape.assign(dims.begin(), dims.end());
    AttentionMask engine_mask;
    engine_mask.dims = dims;
    if (Chance(rng, 0.5)) {
      for (int64_t i = 0; i < count; ++i)
        d.allowed.push_back(Chance(rng, 0.8) ? 1 : 0);
      mask.allowed = d.allowed;
      engine_mask.allowed = d.allowed.data();
    } else {
      std::uniform_real_distribution<float> bias(-2.0f, 2.0f);
      for (int64_t i = 0; i < count; ++i) {
        d.bias.push_back(Chance(rng, 0.1)
                             ? -std::numeric_limits<float>::infinity()
                             : bias(rng));
      }
      mask.bias = d.bias;
      engine_mask.bias = d.bias.data();
    }
    ref.mask = mask;
    o.mask = engine_mask;
  }
  o.key_lengths = d.key_lengths;
  o.return_lse = Chance(rng, 0.5);
  if (Chance(rng, 0.3)) o.precision = Precision::kBFloat16;
  DrawVariants(rng, d);

  std::ostringstream text;
  text << "seed " << seed << ": " << s.DebugString()
       << (o.causal ? (ref.bottom_right ? " causal bottom-right" : " causal")
                    : "")
       << (d.key_lengths.empty() ? "" : " key_lengths")
       << (d.allowed.empty() ? "" : " bool-mask")
       << (d.bias.empty() ? "" : " float-mask")
       << (o.precision == Precision::kBFloat16 ? " bf16" : "")
       << (o.return_lse ? " lse" : "")
       << (!o.causal && ref.bottom_right ? " bottom-right" : "");
  if (o.window_left >= 0 || o.window_right >= 0) {
    text << " window(" << o.window_left << "," << o.window_right << ")";
  }
  if (o.num_sink_tokens > 0) text << " sinks=" << o.num_sink_tokens;
  if (!o.alibi_slopes.empty()) text << " alibi";
  if (o.softcap) text << " softcap=" << *o.softcap;
  d.description = text.str();
  return d;
}

// Runs shape `r` with `options` (return_lse set) on `engine` over random
// inputs drawn from `seed` on, and checks the output and lse against the
// reference with `reference`, at the tolerances of the options' precision.
void ExpectAttendMatchesReference(AttentionEngine& engine,
                                  const ReferenceShape& r,
                                  const AttentionOptions& options,
                                  const ReferenceOptions& reference,
                                  uint64_t seed) {
  const AttentionShape s = SdpaShape(r.batch, r.heads, r.kv_heads, r.query_len,
                                     r.key_len, r.key_dim, r.value_dim);
  const std::vector<float> q = RandomValues(s.QueryElements(), seed);
  const std::vector<float> k = RandomValues(s.KeyElements(), seed + 1);
  const std::vector<float> v = RandomValues(s.ValueElements(), seed + 2);
  std::vector<float> output(s.OutputElements()), lse(s.LseElements());
  ASSERT_TRUE(engine
                  .Attend(s, options, q, k, v,
                          AttentionOutputs(absl::MakeSpan(output), {},
                                           absl::MakeSpan(lse)))
                  .ok());
  const ReferenceResult expected = ReferenceAttention(r, q, k, v, reference);
  const bool bf16 = options.precision == Precision::kBFloat16;
  ExpectNear("output", output, expected.output,
             bf16 ? kOutputBf16 : kOutputF32);
  ExpectNear("lse", lse, expected.lse, bf16 ? kLseBf16 : kLseF32);
}

class FusedMatchesReference : public ::testing::TestWithParam<Variant> {};

TEST_P(FusedMatchesReference, RandomDraws) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine(GetParam());
  uint64_t first_seed = 1;
  int count = kDraws;
  if (const char* seed = std::getenv("ATTNSERVE_FUSED_SEED")) {
    first_seed = std::strtoull(seed, nullptr, 10);
    count = 1;
  }
  for (int n = 0; n < count; ++n) {
    const Draw d = MakeDraw(first_seed + static_cast<uint64_t>(n));
    SCOPED_TRACE(d.description);
    const AttentionShape& s = d.shape;
    std::vector<float> output(s.OutputElements(),
                              std::numeric_limits<float>::quiet_NaN());
    std::vector<float> lse(d.options.return_lse ? s.LseElements() : 0);
    const absl::Status status = engine->Attend(
        s, d.options, d.query, d.key, d.value,
        AttentionOutputs(absl::MakeSpan(output), {}, absl::MakeSpan(lse)));
    ASSERT_TRUE(status.ok()) << status;
    const ReferenceResult expected =
        ReferenceAttention(d.ref_shape, d.query, d.key, d.value, d.reference);
    const bool bf16 = d.options.precision == Precision::kBFloat16;
    ExpectNear("output", output, expected.output,
               bf16 ? kOutputBf16 : kOutputF32);
    if (d.options.return_lse) {
      ExpectNear("lse", lse, expected.lse, bf16 ? kLseBf16 : kLseF32);
    }
    if (HasFatalFailure()) return;
  }
}

// Windows and sinks where tiles mix rows whose window reaches the first key
// block with rows that see it only through their sinks (the kernel runs such
// a block only as far as the sinks for the latter alone), and blocks no row
// sees at all; prefill and decode.
TEST_P(FusedMatchesReference, WindowsAndSinksAcrossKeyBlocks) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine(GetParam());
  for (const int64_t query_len : {int64_t{600}, int64_t{1}, int64_t{70}}) {
    for (const int64_t window : {int64_t{40}, int64_t{290}}) {
      SCOPED_TRACE(absl::StrCat("Lq ", query_len, " window ", window));
      AttentionOptions options;
      options.causal = true;
      options.causal_alignment = CausalAlignment::kBottomRight;
      options.window_left = window;
      options.num_sink_tokens = 3;
      options.return_lse = true;
      ReferenceOptions reference;
      reference.causal = reference.bottom_right = true;
      reference.window_left = window;
      reference.num_sink_tokens = 3;
      ASSERT_NO_FATAL_FAILURE(ExpectAttendMatchesReference(
          *engine, {1, 2, 1, query_len, 900, 16, 16}, options, reference, 71));
    }
  }
}

// Causal tiles of up to 256 queries run the key blocks their rows see
// unequally (the diagonal) band by band, each band of 64 queries as far as it
// sees: groups of one and two, more keys than queries under both alignments,
// tiles and bands cut short, key_lengths that end inside a band, ALiBi with a
// softcap, and both precisions. Two tiles a (batch item, kv head), so that two
// threads keep whole tiles.
TEST_P(FusedMatchesReference, CausalTilesRunTheirDiagonalBandByBand) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine(GetParam());
  struct Case {
    int64_t heads, query_len, key_len;
    bool bottom_right, key_lengths, mods, bf16;
  };
  for (const Case c : {Case{2, 300, 300, false, false, false, false},
                       Case{2, 300, 555, true, false, false, true},
                       Case{2, 300, 555, false, true, false, false},
                       Case{4, 200, 333, true, false, true, false},
                       Case{4, 200, 200, false, true, true, true}}) {
    const ReferenceShape r = {2, c.heads, 2, c.query_len, c.key_len, 16, 16};
    SCOPED_TRACE(absl::StrCat("heads ", c.heads, " Lq ", c.query_len, " Lk ",
                              c.key_len, c.bottom_right ? " bottom-right" : "",
                              c.key_lengths ? " key_lengths" : "",
                              c.mods ? " alibi softcap" : "",
                              c.bf16 ? " bf16" : ""));
    AttentionOptions options;
    ReferenceOptions reference;
    options.causal = reference.causal = true;
    reference.bottom_right = c.bottom_right;
    options.causal_alignment = c.bottom_right ? CausalAlignment::kBottomRight
                                              : CausalAlignment::kTopLeft;
    options.return_lse = true;
    // The first item's keys end inside a band of the first tile.
    const std::vector<int64_t> lengths = {c.key_len - 150, c.key_len};
    if (c.key_lengths) {
      options.key_lengths = lengths;
      reference.key_lengths = lengths;
    }
    std::vector<float> slopes;
    if (c.mods) {
      for (int64_t h = 0; h < c.heads; ++h) slopes.push_back(0.05f * (h + 1));
      options.alibi_slopes = slopes;
      reference.alibi_slopes.assign(slopes.begin(), slopes.end());
      options.softcap = 5.0f;
      reference.softcap = 5.0;
    }
    if (c.bf16) options.precision = Precision::kBFloat16;
    ASSERT_NO_FATAL_FAILURE(
        ExpectAttendMatchesReference(*engine, r, options, reference, 81));
  }
}

// Windowed tiles of up to 256 queries run the key blocks their rows see
// unequally (a window's edges, the diagonal) band by band, each band of 64
// queries over only the keys it sees, trimmed at both ends, and the blocks
// every row sees whole at once: windows to the left, to both sides and
// causal ones, narrower than a band and wider than a tile, with sinks,
// key_lengths, a ragged last block, both precisions; groups of one and two,
// and of four, whose tiles of 64 queries a head are one band, trimmed too.
TEST_P(FusedMatchesReference, WindowedTilesTrimTheirBandsAtBothEnds) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine(GetParam());
  struct Case {
    int64_t heads, query_len, key_len, left, right, sinks;
    bool causal, bottom_right, key_lengths, bf16;
  };
  for (const Case c :
       {Case{2, 600, 600, 100, -1, 0, false, false, false, false},
        Case{2, 300, 700, 130, 70, 0, false, true, false, true},
        Case{2, 1100, 1100, 700, -1, 0, true, false, false, false},
        Case{2, 1100, 1100, 700, -1, 4, true, false, false, true},
        Case{4, 500, 1000, 40, -1, 3, true, true, true, false},
        Case{4, 520, 520, 200, 0, 0, false, false, true, true},
        Case{8, 300, 700, 100, -1, 2, true, true, false, false},
        Case{8, 300, 700, 130, 70, 0, false, false, true, true}}) {
    const ReferenceShape r = {2, c.heads, 2, c.query_len, c.key_len, 16, 16};
    SCOPED_TRACE(absl::StrCat(
        "heads ", c.heads, " Lq ", c.query_len, " Lk ", c.key_len, " window (",
        c.left, ",", c.right, ") sinks ", c.sinks, c.causal ? " causal" : "",
        c.bottom_right ? " bottom-right" : "",
        c.key_lengths ? " key_lengths" : "", c.bf16 ? " bf16" : ""));
    AttentionOptions options;
    ReferenceOptions reference;
    options.causal = reference.causal = c.causal;
    reference.bottom_right = c.bottom_right;
    options.causal_alignment = c.bottom_right ? CausalAlignment::kBottomRight
                                              : CausalAlignment::kTopLeft;
    options.window_left = reference.window_left = c.left;
    options.window_right = reference.window_right = c.right;
    options.num_sink_tokens = reference.num_sink_tokens = c.sinks;
    options.return_lse = true;
    // The first item's keys end inside a tile's window.
    const std::vector<int64_t> lengths = {c.key_len - 170, c.key_len};
    if (c.key_lengths) {
      options.key_lengths = lengths;
      reference.key_lengths = lengths;
    }
    if (c.bf16) options.precision = Precision::kBFloat16;
    ASSERT_NO_FATAL_FAILURE(
        ExpectAttendMatchesReference(*engine, r, options, reference, 91));
  }
}

// Dynamic batching: the draws' batches cut into parts that lie apart in memory
// (B=3 as 1 + 2, B=2 as 1 + 1), computed by one AttendBatch.
TEST_P(FusedMatchesReference, BatchedPartsInPlace) {
  std::unique_ptr<AttentionEngine> engine = MakeEngine(GetParam());
  int tested = 0;
  for (uint64_t seed = 1; tested < kDraws / 3 && seed < 10 * kDraws; ++seed) {
    Draw d = MakeDraw(seed);
    const AttentionShape& s = d.shape;
    if (s.batch == 1 || !d.key_lengths.empty() ||
        (d.options.mask && d.options.mask->dims[0] != 1)) {
      continue;
    }
    ++tested;
    SCOPED_TRACE(d.description);
    if (!engine->AttendBatchable(d.options)) {
      ASSERT_EQ(GetParam().kernel, AttentionKernel::kUnfused);
      AttendPart part;
      EXPECT_EQ(engine->AttendBatch(s, d.options, {&part, 1}).code(),
                absl::StatusCode::kInvalidArgument);
      continue;
    }
    const std::vector<int64_t> sizes =
        s.batch == 3 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 1};
    const int64_t q = s.QueryElements() / s.batch,
                  k = s.KeyElements() / s.batch,
                  v = s.ValueElements() / s.batch,
                  o = s.OutputElements() / s.batch,
                  l = s.LseElements() / s.batch;
    // Each part's tensors in vectors of their own.
    std::vector<std::vector<float>> queries, keys, values, outputs, lses;
    std::vector<AttendPart> parts;
    int64_t first = 0;
    for (const int64_t size : sizes) {
      auto slice = [&](const std::vector<float>& all, int64_t per) {
        return std::vector<float>(all.begin() + first * per,
                                  all.begin() + (first + size) * per);
      };
      queries.push_back(slice(d.query, q));
      keys.push_back(slice(d.key, k));
      values.push_back(slice(d.value, v));
      outputs.emplace_back(size * o, std::numeric_limits<float>::quiet_NaN());
      lses.emplace_back(d.options.return_lse ? size * l : 0);
      first += size;
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      AttendPart part;
      part.batch = sizes[i];
      part.query = queries[i];
      part.key = keys[i];
      part.value = values[i];
      part.outputs = AttentionOutputs(absl::MakeSpan(outputs[i]), {},
                                      absl::MakeSpan(lses[i]));
      parts.push_back(part);
    }
    const absl::Status status = engine->AttendBatch(s, d.options, parts);
    ASSERT_TRUE(status.ok()) << status;
    const ReferenceResult expected =
        ReferenceAttention(d.ref_shape, d.query, d.key, d.value, d.reference);
    const bool bf16 = d.options.precision == Precision::kBFloat16;
    first = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("part ", i));
      ExpectNear(
          "output", outputs[i],
          std::vector<double>(expected.output.begin() + first * o,
                              expected.output.begin() + (first + sizes[i]) * o),
          bf16 ? kOutputBf16 : kOutputF32);
      if (d.options.return_lse) {
        ExpectNear(
            "lse", lses[i],
            std::vector<double>(expected.lse.begin() + first * l,
                                expected.lse.begin() + (first + sizes[i]) * l),
            bf16 ? kLseBf16 : kLseF32);
      }
      first += sizes[i];
    }
    if (HasFatalFailure()) return;
  }
  EXPECT_GE(tested, 10);
}

TEST(FusedAttentionTest, AttendBatchRefusesWhatItCannotBatch) {
  std::unique_ptr<AttentionEngine> engine =
      MakeEngine({"fused", AttentionKernel::kAuto, false, 2});
  const AttentionShape shape = SdpaShape(1, 2, 2, 4, 4, 8);
  std::vector<float> values(static_cast<size_t>(shape.QueryElements()), 0.5f);
  std::vector<float> output(static_cast<size_t>(shape.OutputElements()));
  AttendPart part;
  part.query = part.key = part.value = values;
  part.outputs = AttentionOutputs(absl::MakeSpan(output));
  ASSERT_TRUE(engine->AttendBatch(shape, {}, {&part, 1}).ok());

  AttentionOptions weights;
  weights.weights = AttentionWeightsMode::kPerHead;
  const int64_t key_lengths[] = {2};
  AttentionOptions lengths;
  lengths.key_lengths = key_lengths;
  for (const AttentionOptions& options : {weights, lengths}) {
    EXPECT_FALSE(engine->AttendBatchable(options));
    EXPECT_EQ(engine->AttendBatch(shape, options, {&part, 1}).code(),
              absl::StatusCode::kInvalidArgument);
  }
  AttendPart short_part = part;
  short_part.key = absl::MakeConstSpan(values).subspan(1);
  const AttendPart two[] = {part, short_part};
  const absl::Status status = engine->AttendBatch(shape, {}, two);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("part 1"));
  EXPECT_EQ(engine->AttendBatch(shape, {}, {}).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, FusedMatchesReference,
    ::testing::Values(
        Variant{"FusedAvx512OneThread", AttentionKernel::kAuto, false, 1},
        Variant{"FusedAvx512TwoThreads", AttentionKernel::kAuto, false, 2},
        Variant{"FusedPortableOneThread", AttentionKernel::kAuto, true, 1},
        Variant{"FusedPortableTwoThreads", AttentionKernel::kAuto, true, 2},
        Variant{"Unfused", AttentionKernel::kUnfused, false, 2}),
    [](const ::testing::TestParamInfo<Variant>& param) {
      return param.param.name;
    });

TEST(FusedAttentionTest, ScratchDoesNotGrowWithTheScores) {
  // B=1, H=8, L=32768, D=64: the scores would be 32 GiB; the fused kernel's
  // scratch is a few tiles per thread.
  const AttentionShape shape = SdpaShape(1, 8, 8, 32768, 32768, 64);
  std::unique_ptr<AttentionEngine> fused =
      MakeEngine({"fused", AttentionKernel::kAuto, false, 2});
  const std::optional<int64_t> bytes =
      fused->AttendWorkspaceBytes(shape, AttentionOptions{});
  ASSERT_TRUE(bytes.has_value());
  EXPECT_LT(*bytes, int64_t{4} << 20);
  // Asking for the weights needs the scores, hence the unfused path's slabs
  // (4M scores between polls of the call).
  AttentionOptions weights;
  weights.weights = AttentionWeightsMode::kPerHead;
  EXPECT_GE(fused->AttendWorkspaceBytes(shape, weights).value(),
            int64_t{16} << 20);
}

TEST(FusedAttentionTest, RowsThatSeeNoKeyGetZerosAndMinusInfinityLse) {
  // Batch item 0 has no keys; under bottom-right causality with 3 keys, the
  // first 2 of 5 queries of item 1 see none.
  const AttentionShape shape = SdpaShape(2, 2, 1, 5, 300, 16);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 7);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 8);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 9);
  const std::vector<int64_t> key_lengths = {0, 3};
  AttentionOptions options;
  options.key_lengths = key_lengths;
  options.causal = true;
  options.causal_alignment = CausalAlignment::kBottomRight;
  options.return_lse = true;
  for (const bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "portable" : "avx512");
    std::vector<float> output(shape.OutputElements(), 5.0f);
    std::vector<float> lse(shape.LseElements(), 5.0f);
    ASSERT_TRUE(MakeEngine({"fused", AttentionKernel::kAuto, portable, 2})
                    ->Attend(shape, options, query, key, value,
                             AttentionOutputs(absl::MakeSpan(output), {},
                                              absl::MakeSpan(lse)))
                    .ok());
    const float minus_inf = -std::numeric_limits<float>::infinity();
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 5; ++i) {
        const bool sees_none = i < 2;
        EXPECT_EQ(lse[static_cast<size_t>(h * 5 + i)], minus_inf);
        const float item1_lse = lse[static_cast<size_t>((2 + h) * 5 + i)];
        if (sees_none) {
          EXPECT_EQ(item1_lse, minus_inf);
        } else {
          EXPECT_TRUE(std::isfinite(item1_lse));
        }
        for (int64_t c = 0; c < 16; ++c) {
          EXPECT_EQ(output[static_cast<size_t>((h * 5 + i) * 16 + c)], 0.0f);
          if (sees_none) {
            EXPECT_EQ(output[static_cast<size_t>(((2 + h) * 5 + i) * 16 + c)],
                      0.0f);
          }
        }
      }
    }
  }
}

TEST(FusedAttentionTest, NaNInAKeyMakesOnlyTheRowsThatSeeItNaN) {
  // Key 550 of 600 is NaN: under bottom-right causality query i sees keys up
  // to i + 500, so queries 0..49 stay finite and 50..99 are NaN. Two threads
  // and two tiles split the keys, so the merge must carry the NaN too.
  const AttentionShape shape = SdpaShape(1, 1, 1, 100, 600, 8);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 1);
  std::vector<float> key = RandomValues(shape.KeyElements(), 2);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 3);
  key[550 * 8 + 3] = std::numeric_limits<float>::quiet_NaN();
  AttentionOptions options;
  options.causal = true;
  options.causal_alignment = CausalAlignment::kBottomRight;
  for (const int threads : {1, 2}) {
    for (const bool portable : {false, true}) {
      SCOPED_TRACE(absl::StrCat(portable ? "portable" : "avx512", ", threads ",
                                threads));
      std::vector<float> output(shape.OutputElements());
      ASSERT_TRUE(
          MakeEngine({"fused", AttentionKernel::kAuto, portable, threads})
              ->Attend(shape, options, query, key, value,
                       absl::MakeSpan(output))
              .ok());
      for (int64_t i = 0; i < 100; ++i) {
        EXPECT_EQ(std::isnan(output[static_cast<size_t>(i * 8)]), i >= 50)
            << "query " << i;
      }
    }
  }
}

TEST(FusedAttentionTest, DecodeSplitsKeysAndMergesExactly) {
  // One query row and 4097 keys: with two threads the single tile's keys are
  // split into chunks, whose merge must match one pass within f32 rounding.
  const AttentionShape shape = SdpaShape(1, 1, 1, 1, 4097, 64);
  const std::vector<float> query = RandomValues(shape.QueryElements(), 11);
  const std::vector<float> key = RandomValues(shape.KeyElements(), 12);
  const std::vector<float> value = RandomValues(shape.ValueElements(), 13);
  AttentionOptions options;
  options.return_lse = true;
  std::vector<float> split_output(64), one_output(64), split_lse(1), one_lse(1);
  ASSERT_TRUE(MakeEngine({"two", AttentionKernel::kAuto, false, 2})
                  ->Attend(shape, options, query, key, value,
                           AttentionOutputs(absl::MakeSpan(split_output), {},
                                            absl::MakeSpan(split_lse)))
                  .ok());
  ASSERT_TRUE(MakeEngine({"one", AttentionKernel::kAuto, false, 1})
                  ->Attend(shape, options, query, key, value,
                           AttentionOutputs(absl::MakeSpan(one_output), {},
                                            absl::MakeSpan(one_lse)))
                  .ok());
  for (size_t c = 0; c < 64; ++c) {
    EXPECT_NEAR(split_output[c], one_output[c], 1e-6) << c;
  }
  EXPECT_NEAR(split_lse[0], one_lse[0], 1e-5);
}

// The same call on the same engine gives the same bits every time, however
// OpenMP hands its tiles and key splits to the threads (docs/api.md promises
// it for a server with --max_batch=1): decode split over the keys, a tile's
// keys split four ways, causal bands, BF16 precision, and decode over bf16
// keys and values read in place.
TEST(FusedAttentionTest, ACallRepeatsItsAnswerBitForBit) {
  const std::unique_ptr<AttentionEngine> engine =
      MakeEngine({"two", AttentionKernel::kAuto, false, 2});
  struct Case {
    AttentionShape shape;
    bool causal;
    Precision precision;
    bool half_decode;
  };
  const Case cases[] = {
      {SdpaShape(1, 1, 1, 1, 4097, 64), false, Precision::kFloat32, false},
      {SdpaShape(1, 2, 2, 5, 513, 128), false, Precision::kFloat32, false},
      {SdpaShape(2, 8, 2, 300, 700, 64), true, Precision::kFloat32, false},
      {SdpaShape(1, 4, 4, 37, 1500, 80), false, Precision::kBFloat16, false},
      {SdpaShape(3, 8, 2, 1, 3000, 128), false, Precision::kFloat32, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("Lq ", c.shape.query_len, " Lk ", c.shape.key_len,
                              " causal ", c.causal));
    const AttentionShape& s = c.shape;
    const std::vector<float> query = RandomValues(s.QueryElements(), 21);
    const std::vector<float> key = RandomValues(s.KeyElements(), 22);
    const std::vector<float> value = RandomValues(s.ValueElements(), 23);
    std::vector<uint16_t> half_key, half_value;
    for (float x : key) half_key.push_back(Float32ToBFloat16(x));
    for (float x : value) half_value.push_back(Float32ToBFloat16(x));
    AttentionOptions options;
    options.causal = c.causal;
    options.precision = c.precision;
    options.return_lse = true;
    std::vector<float> first_output, first_lse;
    for (int run = 0; run < 4; ++run) {
      std::vector<float> output(s.OutputElements()),
          lse(s.batch * s.heads * s.query_len);
      const AttentionOutputs outputs(absl::MakeSpan(output), {},
                                     absl::MakeSpan(lse));
      const absl::Status status =
          c.half_decode
              ? engine->AttendDecode(
                    s, options, query, DataType::kBFloat16,
                    {reinterpret_cast<const char*>(half_key.data()),
                     half_key.size() * 2},
                    {reinterpret_cast<const char*>(half_value.data()),
                     half_value.size() * 2},
                    outputs)
              : engine->Attend(s, options, query, key, value, outputs);
      ASSERT_TRUE(status.ok()) << status;
      if (run == 0) {
        first_output = output;
        first_lse = lse;
        continue;
      }
      EXPECT_EQ(std::memcmp(output.data(), first_output.data(),
                            output.size() * sizeof(float)),
                0)
          << "run " << run;
      EXPECT_EQ(
          std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(float)),
          0)
          << "run " << run;
    }
  }
}

// Requests of one B batched by AttendBatch get the bits each gets alone from
// Attend: the batch cuts each into the tiles and key splits it would have
// alone (one thread for a call too small to share, keys split for one of few
// tiles), whatever the batch's own size would call for.
TEST(FusedAttentionTest, ABatchedRequestGetsTheBitsItGetsAlone) {
  const std::unique_ptr<AttentionEngine> engine =
      MakeEngine({"two", AttentionKernel::kAuto, false, 2});
  struct Case {
    AttentionShape part;
    int parts;
    bool causal;
    Precision precision;
  };
  const Case cases[] = {
      {SdpaShape(1, 2, 2, 5, 513, 128), 8, false, Precision::kFloat32},
      {SdpaShape(1, 8, 2, 37, 700, 64), 4, true, Precision::kFloat32},
      {SdpaShape(2, 4, 4, 3, 1000, 80), 3, false, Precision::kBFloat16},
      {SdpaShape(1, 1, 1, 16, 16, 64), 5, false, Precision::kFloat32},
      {SdpaShape(1, 4, 4, 300, 300, 64), 3, true, Precision::kBFloat16},
  };
  for (const Case& c : cases) {
    const AttentionShape& s = c.part;
    SCOPED_TRACE(absl::StrCat(c.parts, " parts of ", s.DebugString()));
    AttentionOptions options;
    options.causal = c.causal;
    options.precision = c.precision;
    options.return_lse = true;
    std::vector<std::vector<float>> queries, keys, values, outputs, lses;
    for (int i = 0; i < c.parts; ++i) {
      queries.push_back(RandomValues(s.QueryElements(), 100 + 3 * i));
      keys.push_back(RandomValues(s.KeyElements(), 101 + 3 * i));
      values.push_back(RandomValues(s.ValueElements(), 102 + 3 * i));
      outputs.emplace_back(s.OutputElements());
      lses.emplace_back(s.LseElements());
    }
    std::vector<AttendPart> parts;
    for (int i = 0; i < c.parts; ++i) {
      AttendPart part;
      part.batch = s.batch;
      part.query = queries[i];
      part.key = keys[i];
      part.value = values[i];
      part.outputs = AttentionOutputs(absl::MakeSpan(outputs[i]), {},
                                      absl::MakeSpan(lses[i]));
      parts.push_back(part);
    }
    const absl::Status batched = engine->AttendBatch(s, options, parts);
    ASSERT_TRUE(batched.ok()) << batched;
    for (int i = 0; i < c.parts; ++i) {
      std::vector<float> output(s.OutputElements()), lse(s.LseElements());
      const absl::Status alone = engine->Attend(
          s, options, queries[i], keys[i], values[i],
          AttentionOutputs(absl::MakeSpan(output), {}, absl::MakeSpan(lse)));
      ASSERT_TRUE(alone.ok()) << alone;
      EXPECT_EQ(std::memcmp(output.data(), outputs[i].data(),
                            output.size() * sizeof(float)),
                0)
          << "part " << i;
      EXPECT_EQ(
          std::memcmp(lse.data(), lses[i].data(), lse.size() * sizeof(float)),
          0)
          << "part " << i;
    }
  }
}

// Parts whose lone key splits together pass the workspace limit, though each
// alone fits, are computed one after the other, with the bits they get alone.
TEST(FusedAttentionTest, ABatchOverTheWorkspaceLimitComputesItsPartsAlone) {
  const AttentionShape s = SdpaShape(1, 2, 2, 5, 513, 128);
  AttentionOptions options;
  EngineOptions limited;
  limited.num_threads = 2;
  limited.max_workspace_bytes =
      MakeEngine({"two", AttentionKernel::kAuto, false, 2})
          ->AttendWorkspaceBytes(s, options)
          .value();
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine =
      AttentionEngine::Create(limited);
  ASSERT_TRUE(engine.ok()) << engine.status();
  constexpr int kParts = 16;
  std::vector<std::vector<float>> queries, keys, values, outputs;
  std::vector<AttendPart> parts;
  for (int i = 0; i < kParts; ++i) {
    queries.push_back(RandomValues(s.QueryElements(), 200 + 3 * i));
    keys.push_back(RandomValues(s.KeyElements(), 201 + 3 * i));
    values.push_back(RandomValues(s.ValueElements(), 202 + 3 * i));
    outputs.emplace_back(s.OutputElements());
  }
  for (int i = 0; i < kParts; ++i) {
    AttendPart part;
    part.batch = 1;
    part.query = queries[i];
    part.key = keys[i];
    part.value = values[i];
    part.outputs = AttentionOutputs(absl::MakeSpan(outputs[i]));
    parts.push_back(part);
  }
  const absl::Status batched = (*engine)->AttendBatch(s, options, parts);
  ASSERT_TRUE(batched.ok()) << batched;
  for (int i = 0; i < kParts; ++i) {
    std::vector<float> output(s.OutputElements());
    ASSERT_TRUE((*engine)
                    ->Attend(s, options, queries[i], keys[i], values[i],
                             AttentionOutputs(absl::MakeSpan(output)))
                    .ok());
    EXPECT_EQ(std::memcmp(output.data(), outputs[i].data(),
                          output.size() * sizeof(float)),
              0)
        << "part " << i;
  }
}

TEST(FusedAttentionTest, ReportsWhichKernelsRun) {
  EXPECT_EQ(MakeEngine({"portable", AttentionKernel::kAuto, true, 1})
                ->runtime_info()
                .kernels,
            "portable");
  EXPECT_THAT(MakeEngine({"auto", AttentionKernel::kAuto, false, 1})
                  ->runtime_info()
                  .kernels,
              ::testing::AnyOf("avx512", "portable"));
}

}  // namespace
}  // namespace attnserve
