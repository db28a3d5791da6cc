// AttentionEngine::AttendPaged against the double-precision reference and
// against a stateless Attend of the same keys and values (bottom-right
// causal), over random page sizes, page boundaries, GQA, Tq, storage dtypes,
// precisions, splits and many items per call, on this CPU's best code, on the
// AVX2 code (where the CPU has AVX2) and on the portable code.
#include "attnserve/core/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceShape;

// One sequence's cache in pages, built from f32 keys [Hkv, L, Dk] and values
// [Hkv, L, Dv], and the values it holds once stored (rounded to its dtype).
struct PagedCache {
  PageLayout layout;
  std::vector<std::vector<char>> pages;
  std::vector<const char*> page_pointers;
  std::vector<float> stored_key, stored_value;  // [Hkv, L, D] as stored

  PagedCache(const PageLayout& page_layout, int64_t length,
             const std::vector<float>& key, const std::vector<float>& value)
      : layout(page_layout) {
    const int64_t hkv = layout.kv_heads;
    const int64_t element = DataTypeBytes(layout.dtype);
    const int64_t count =
        (length + layout.page_tokens - 1) / layout.page_tokens;
    // Pages are filled with NaN bytes past the length, which must never reach
    // a result (the kernel reads whole vectors of keys laid out by dimension,
    // and drops the lanes past the length).
    pages.assign(static_cast<size_t>(count),
                 std::vector<char>(static_cast<size_t>(layout.PageBytes()),
                                   static_cast<char>(0xff)));
    stored_key.resize(key.size());
    stored_value.resize(value.size());
    // Head h's keys at h · (a head's keys and values), then its values.
    const int64_t key_bytes = layout.page_tokens * layout.key_dim * element;
    const int64_t head_bytes =
        key_bytes + layout.page_tokens * layout.value_dim * element;
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t t = 0; t < length; ++t) {
        char* page = pages[static_cast<size_t>(t / layout.page_tokens)].data();
        char* head_keys = page + h * head_bytes;
        char* head_values = head_keys + key_bytes;
        const int64_t slot = t % layout.page_tokens;
        const float* key_row = key.data() + (h * length + t) * layout.key_dim;
        float* stored_row =
            stored_key.data() + (h * length + t) * layout.key_dim;
        if (layout.keys_transposed) {
          // [Dk, page_tokens]: element d of the key at column t.
          for (int64_t d = 0; d < layout.key_dim; ++d) {
            Store(key_row + d, 1,
                  head_keys + (d * layout.page_tokens + slot) * element,
                  stored_row + d);
          }
        } else {
          Store(key_row, layout.key_dim,
                head_keys + slot * layout.key_dim * element, stored_row);
        }
        Store(value.data() + (h * length + t) * layout.value_dim,
              layout.value_dim, head_values + slot * layout.value_dim * element,
              stored_value.data() + (h * length + t) * layout.value_dim);
      }
    }
    for (const std::vector<char>& page : pages) {
      page_pointers.push_back(page.data());
    }
  }

  void Store(const float* source, int64_t count, char* destination,
             float* stored) const {
    ConvertFromFloat32(source, count, layout.dtype, destination);
    ConvertToFloat32(layout.dtype, destination, count, stored);
  }
};

struct Case {
  int64_t heads, kv_heads, query_len, length, key_dim, value_dim, page_tokens;
  DataType dtype;
  Precision precision;
  bool return_lse;
  bool keys_transposed = false;  // The test's parameter sets it.
  // Variants: a window (−1: none), sinks, ALiBi slopes, a softcap (0: none),
  // and the pages none of the rows sees passed as null (evicted).
  int64_t window_left = -1;
  int64_t sinks = 0;
  bool alibi = false;
  float softcap = 0.0f;
  bool null_unseen_pages = false;
};

std::string Describe(const Case& c) {
  return absl::StrCat(
      "H=", c.heads, " Hkv=", c.kv_heads, " Tq=", c.query_len, " L=", c.length,
      " Dk=", c.key_dim, " Dv=", c.value_dim, " page=", c.page_tokens,
      " dtype=", static_cast<int>(c.dtype),
      " bf16=", c.precision == Precision::kBFloat16,
      " window_left=", c.window_left, " sinks=", c.sinks, " alibi=", c.alibi,
      " softcap=", c.softcap, " null_unseen_pages=", c.null_unseen_pages,
      " keys_transposed=", c.keys_transposed);
}

// The inputs and outputs of one item.
struct Item {
  Case c;
  std::unique_ptr<PagedCache> cache;
  std::vector<float> query, output, lse;
  std::vector<float> slopes;       // [H] if c.alibi
  std::vector<const char*> pages;  // as the call reads them
};

Item MakeItem(const Case& c, uint64_t seed) {
  Item item;
  item.c = c;
  PageLayout layout;
  layout.page_tokens = c.page_tokens;
  layout.kv_heads = c.kv_heads;
  layout.key_dim = c.key_dim;
  layout.value_dim = c.value_dim;
  layout.dtype = c.dtype;
  layout.keys_transposed = c.keys_transposed;
  item.cache = std::make_unique<PagedCache>(
      layout, c.length, RandomValues(c.kv_heads * c.length * c.key_dim, seed),
      RandomValues(c.kv_heads * c.length * c.value_dim, seed + 1));
  item.query = RandomValues(c.heads * c.query_len * c.key_dim, seed + 2);
  item.output.assign(static_cast<size_t>(c.heads * c.query_len * c.value_dim),
                     -7.0f);
  if (c.return_lse) {
    item.lse.assign(static_cast<size_t>(c.heads * c.query_len), -7.0f);
  }
  for (int64_t h = 0; c.alibi && h < c.heads; ++h) {
    item.slopes.push_back(static_cast<float>(
        std::pow(2.0, -8.0 * static_cast<double>(h + 1) / c.heads)));
  }
  item.pages = item.cache->page_pointers;
  if (c.null_unseen_pages && c.window_left >= 0) {
    // Query 0 sees the least: keys from L − Tq − window_left on, and the
    // sinks. A page wholly between those no row sees.
    const int64_t window_start = c.length - c.query_len - c.window_left;
    for (size_t p = 0; p < item.pages.size(); ++p) {
      const int64_t first = static_cast<int64_t>(p) * c.page_tokens;
      const int64_t last = std::min(first + c.page_tokens, c.length);
      if (first >= c.sinks && last <= window_start) item.pages[p] = nullptr;
    }
  }
  return item;
}

// Options of the same variants for the reference and for Attend.
ReferenceOptions ReferenceVariants(const Item& item) {
  ReferenceOptions options;
  options.window_left = item.c.window_left;
  options.num_sink_tokens = item.c.sinks;
  options.alibi_slopes.assign(item.slopes.begin(), item.slopes.end());
  if (item.c.softcap > 0.0f) options.softcap = item.c.softcap;
  return options;
}

PagedAttend ToPaged(Item& item, float scale) {
  PagedAttend paged;
  paged.layout = item.cache->layout;
  paged.pages = item.pages;
  paged.window_left = item.c.window_left;
  paged.num_sink_tokens = item.c.sinks;
  paged.softcap = item.c.softcap;
  paged.alibi_slopes = item.slopes;
  paged.length = item.c.length;
  paged.heads = item.c.heads;
  paged.query_len = item.c.query_len;
  paged.query = item.query;
  paged.scale = scale;
  paged.precision = item.c.precision;
  paged.output = absl::MakeSpan(item.output);
  paged.lse = absl::MakeSpan(item.lse);
  return paged;
}

// The kernel code a test runs: the best this CPU has, the AVX2 code (what
// CPUs without AVX-512 run), or the portable code.
enum class Code { kNative, kAvx2, kPortable };

// Parameters: the kernel code, and keys laid out by dimension (the sessions'
// pages; else as rows).
class PagedAttentionTest
    : public ::testing::TestWithParam<std::tuple<Code, bool>> {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.num_threads = 2;
    options.portable_kernels = std::get<0>(GetParam()) == Code::kPortable;
    options.avx2_kernels = std::get<0>(GetParam()) == Code::kAvx2;
    auto engine = AttentionEngine::Create(options);
    if (!engine.ok() && options.avx2_kernels) {
      GTEST_SKIP() << "the AVX2 code needs a CPU with AVX2 and FMA: "
                   << engine.status();
    }
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  // MakeItem with the keys laid out as the parameter says.
  Item Make(Case c, uint64_t seed) {
    c.keys_transposed = std::get<1>(GetParam());
    return MakeItem(c, seed);
  }

  // Checks one item against the reference over its stored keys and values,
  // and (f32 precision) against a stateless Attend of them.
  void Check(Item& item, float scale) {
    const Case& c = item.c;
    SCOPED_TRACE(Describe(c));
    const ReferenceShape shape{1,        c.heads,   c.kv_heads, c.query_len,
                               c.length, c.key_dim, c.value_dim};
    ReferenceOptions options = ReferenceVariants(item);
    options.scale = scale;
    options.causal = true;
    options.bottom_right = true;
    const auto expected =
        ReferenceAttention(shape, item.query, item.cache->stored_key,
                           item.cache->stored_value, options);
    const bool bf16 = c.precision == Precision::kBFloat16;
    ExpectNear("output", item.output, expected.output,
               bf16 ? testing::kOutputBf16 : testing::kOutputF32);
    if (c.return_lse) {
      ExpectNear("lse", item.lse, expected.lse,
                 bf16 ? testing::kLseBf16 : testing::kLseF32);
    }
    if (bf16 || c.length == 0) return;
    AttentionShape stateless;
    stateless.heads = c.heads;
    stateless.kv_heads = c.kv_heads;
    stateless.query_len = c.query_len;
    stateless.key_len = c.length;
    stateless.key_dim = c.key_dim;
    stateless.value_dim = c.value_dim;
    AttentionOptions attend;
    attend.scale = scale;
    attend.causal = true;
    attend.causal_alignment = CausalAlignment::kBottomRight;
    attend.window_left = c.window_left;
    attend.num_sink_tokens = c.sinks;
    attend.alibi_slopes = item.slopes;
    if (c.softcap > 0.0f) attend.softcap = c.softcap;
    std::vector<float> output(item.output.size());
    ASSERT_TRUE(engine_
                    ->Attend(stateless, attend, item.query,
                             item.cache->stored_key, item.cache->stored_value,
                             absl::MakeSpan(output))
                    .ok());
    // The two kernels sum in different orders, a few f32 roundings apart:
    // within 1e-6 relative (the sessions' promise; 2e-7 held too).
    for (size_t i = 0; i < output.size(); ++i) {
      ASSERT_NEAR(item.output[i], output[i],
                  1e-6 * std::max(1.0f, std::abs(output[i])))
          << "against Attend at " << i;
    }
  }

  std::unique_ptr<AttentionEngine> engine_;
};

TEST_P(PagedAttentionTest, DecodeStepOverPagesOfEveryDtype) {
  for (const DataType dtype :
       {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    Item item =
        Make({8, 2, 1, 300, 64, 64, 64, dtype, Precision::kFloat32, true}, 11);
    const PagedAttend paged = ToPaged(item, 0.125f);
    ASSERT_TRUE(engine_->AttendPaged({&paged, 1}).ok());
    Check(item, 0.125f);
  }
}

// BF16 precision reads f32 and f16 pages as their values rounded to bf16: the
// same as bf16 pages holding those rounded values, to within the two kernels'
// summation orders, where unrounded keys and values would differ by bf16's
// rounding (~2e-3).
TEST_P(PagedAttentionTest, Bf16PrecisionReadsWiderPagesRounded) {
  for (const DataType dtype : {DataType::kFloat32, DataType::kFloat16}) {
    SCOPED_TRACE(static_cast<int>(dtype));
    Item wide = Make(
        {8, 2, 2, 300, 64, 64, 64, dtype, Precision::kBFloat16, false}, 31);
    const PagedAttend wide_paged = ToPaged(wide, 0.125f);
    ASSERT_TRUE(engine_->AttendPaged({&wide_paged, 1}).ok());
    Item narrow = Make({8, 2, 2, 300, 64, 64, 64, DataType::kBFloat16,
                        Precision::kBFloat16, false},
                       31);
    // The wide pages' values as stored (f16 already rounded once), put in
    // bf16 pages: the rounding BF16 precision applies to them.
    narrow.cache = std::make_unique<PagedCache>(
        narrow.cache->layout, narrow.c.length, wide.cache->stored_key,
        wide.cache->stored_value);
    narrow.pages = narrow.cache->page_pointers;
    narrow.query = wide.query;
    const PagedAttend narrow_paged = ToPaged(narrow, 0.125f);
    ASSERT_TRUE(engine_->AttendPaged({&narrow_paged, 1}).ok());
    for (size_t i = 0; i < wide.output.size(); ++i) {
      ASSERT_NEAR(wide.output[i], narrow.output[i],
                  1e-5 * std::max(1.0f, std::abs(narrow.output[i])))
          << "at " << i;
    }
  }
}

TEST_P(PagedAttentionTest, RandomItemsInOneCall) {
  std::mt19937_64 rng(20261201);
  const auto pick = [&rng](std::initializer_list<int64_t> values) {
    std::uniform_int_distribution<size_t> at(0, values.size() - 1);
    return *(values.begin() + at(rng));
  };
  for (int round = 0; round < 12; ++round) {
    std::vector<Item> items;
    const int count = static_cast<int>(pick({1, 2, 5, 9}));
    for (int i = 0; i < count; ++i) {
      Case c;
      c.kv_heads = pick({1, 2, 3});
      c.heads = c.kv_heads * pick({1, 2, 4, 7});
      c.query_len = pick({1, 1, 2, 3, 17, 70});
      c.length = pick({0, 1, 5, 63, 64, 65, 129, 200, 513});
      c.key_dim = pick({1, 8, 33, 48, 64, 96});
      c.value_dim = pick({c.key_dim, 16, 5});
      c.page_tokens = pick({1, 7, 16, 64, 100});
      c.dtype = static_cast<DataType>(pick({0, 1, 2}));
      c.precision =
          pick({0, 0, 1}) == 1 ? Precision::kBFloat16 : Precision::kFloat32;
      c.return_lse = pick({0, 1}) == 1;
      if (pick({0, 1}) == 1) {
        c.window_left = pick({-1, 0, 3, 40, 130});
        c.sinks = pick({0, 0, 1, 4, 20});
        c.alibi = pick({0, 1}) == 1;
        c.softcap = static_cast<float>(pick({0, 0, 1, 30}));
        c.null_unseen_pages = pick({0, 1}) == 1;
      }
      items.push_back(Make(c, static_cast<uint64_t>(round * 100 + i)));
    }
    std::vector<PagedAttend> paged;
    for (Item& item : items) {
      paged.push_back(
          ToPaged(item, 1.0f / std::sqrt(static_cast<float>(item.c.key_dim))));
    }
    ASSERT_TRUE(engine_->AttendPaged(paged).ok());
    for (size_t i = 0; i < items.size(); ++i) {
      Check(items[i], paged[i].scale);
    }
  }
}

// Key counts, page sizes and GQA groups that are not multiples of four, over
// head dims in runs of 32: the AVX-512 unit scores four keys and four rows a
// step (BlockScoresFourKeys), repeating the last key of a block and zeroing
// the rows past the group's.
TEST_P(PagedAttentionTest, KeysAndRowsPastMultiplesOfFour) {
  std::vector<Item> items;
  uint64_t seed = 300;
  for (const DataType dtype :
       {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    for (const int64_t dim : {32, 64, 128}) {
      for (const int64_t group : {1, 3, 8}) {
        for (const int64_t length : {1, 3, 66, 301}) {
          items.push_back(Make(
              {2 * group, 2, length > 1 ? 1 + length % 2 : 1, length, dim, dim,
               length % 7 == 0 ? 64 : 7, dtype, Precision::kFloat32, true},
              ++seed));
        }
      }
    }
  }
  std::vector<PagedAttend> paged;
  for (Item& item : items) paged.push_back(ToPaged(item, 0.3f));
  ASSERT_TRUE(engine_->AttendPaged(paged).ok());
  for (Item& item : items) Check(item, 0.3f);
}

TEST_P(PagedAttentionTest, SinksAndAWindowReadOnlyTheirPages) {
  // 4 sinks and a 64-key window over 2,000 tokens in pages of 16: the pages
  // in between are null, as a session's evicted ones are.
  Case c{4,   2, 3, 2000, 32, 32, 16, DataType::kBFloat16, Precision::kFloat32,
         true};
  c.window_left = 64;
  c.sinks = 4;
  c.alibi = true;
  c.softcap = 20.0f;
  c.null_unseen_pages = true;
  Item item = Make(c, 41);
  ASSERT_GT(std::count(item.pages.begin(), item.pages.end(), nullptr), 100);
  const PagedAttend paged = ToPaged(item, 0.2f);
  ASSERT_TRUE(engine_->AttendPaged({&paged, 1}).ok());
  Check(item, 0.2f);
}

TEST_P(PagedAttentionTest, RefusesANullPageThatARowSees) {
  Case c{2,    1, 1, 100, 8, 8, 10, DataType::kFloat32, Precision::kFloat32,
         false};
  c.window_left = 20;
  c.sinks = 5;
  Item item = Make(c, 42);
  // Page 0 holds the sinks; pages 1 to 6 (keys 10 to 69) no row sees; page
  // 7 (70 to 79) holds the window's first key, 79.
  for (const size_t p : {size_t{1}, size_t{6}}) {
    std::vector<const char*> pages = item.pages;
    pages[p] = nullptr;
    PagedAttend paged = ToPaged(item, 0.3f);
    paged.pages = pages;
    EXPECT_TRUE(engine_->AttendPaged({&paged, 1}).ok()) << p;
  }
  for (const size_t p : {size_t{0}, size_t{7}, size_t{9}}) {
    std::vector<const char*> pages = item.pages;
    pages[p] = nullptr;
    PagedAttend paged = ToPaged(item, 0.3f);
    paged.pages = pages;
    const absl::Status status = engine_->AttendPaged({&paged, 1});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << p;
    EXPECT_NE(status.message().find(absl::StrCat("page ", p, " is null")),
              std::string::npos)
        << status;
  }
}

TEST_P(PagedAttentionTest, RowsThatSeeNoKeyGetZeroAndMinusInfinity) {
  // Tq > L: the first Tq − L rows see no key.
  Item item = Make(
      {2, 1, 5, 3, 8, 8, 4, DataType::kFloat32, Precision::kFloat32, true}, 3);
  const PagedAttend paged = ToPaged(item, 0.5f);
  ASSERT_TRUE(engine_->AttendPaged({&paged, 1}).ok());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(item.lse[static_cast<size_t>(h * 5 + i)],
                -std::numeric_limits<float>::infinity());
      EXPECT_EQ(item.output[static_cast<size_t>((h * 5 + i) * 8)], 0.0f);
    }
  }
  Check(item, 0.5f);
}

TEST_P(PagedAttentionTest, RefusesItemsThatDoNotFit) {
  Item item = Make(
      {4, 2, 1, 130, 8, 8, 64, DataType::kFloat32, Precision::kFloat32, false},
      5);
  PagedAttend paged = ToPaged(item, 0.5f);
  paged.pages = paged.pages.subspan(0, 2);  // 130 tokens need 3 pages.
  absl::Status status = engine_->AttendPaged({&paged, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("expected at least 3"), std::string::npos)
      << status;
  paged = ToPaged(item, 0.5f);
  paged.heads = 3;
  status = engine_->AttendPaged({&paged, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("heads is 3"), std::string::npos) << status;
}

// Values apart from the keys (value_pages, as a stateless call's tensors
// are read) give what values after the keys in one page give, bit for bit.
TEST_P(PagedAttentionTest, ValuePagesApartFromTheKeys) {
  for (const DataType dtype :
       {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    Item item =
        Make({8, 2, 1, 150, 32, 48, 64, dtype, Precision::kFloat32, true}, 17);
    const PagedAttend together = ToPaged(item, 0.25f);
    ASSERT_TRUE(engine_->AttendPaged({&together, 1}).ok());
    const std::vector<float> output = item.output, lse = item.lse;
    // Each page's keys and values copied to buffers of their own, each
    // [Hkv, ...], as a stateless call's tensors.
    const PageLayout& layout = item.cache->layout;
    std::vector<std::vector<char>> keys, values;
    std::vector<const char*> key_pages, value_pages;
    for (const std::vector<char>& page : item.cache->pages) {
      std::vector<char>& k = keys.emplace_back();
      std::vector<char>& v = values.emplace_back();
      for (int64_t h = 0; h < layout.kv_heads; ++h) {
        const auto head_keys = page.begin() + layout.KeysAt(h);
        const auto head_values = page.begin() + layout.ValuesAt(h);
        k.insert(k.end(), head_keys, head_keys + layout.HeadKeyBytes());
        v.insert(v.end(), head_values, head_values + layout.HeadValueBytes());
      }
    }
    for (size_t p = 0; p < keys.size(); ++p) {
      key_pages.push_back(keys[p].data());
      value_pages.push_back(values[p].data());
    }
    PagedAttend apart = ToPaged(item, 0.25f);
    apart.pages = key_pages;
    apart.value_pages = value_pages;
    std::fill(item.output.begin(), item.output.end(), -7.0f);
    ASSERT_TRUE(engine_->AttendPaged({&apart, 1}).ok());
    EXPECT_EQ(item.output, output);
    EXPECT_EQ(item.lse, lse);
    apart.value_pages = absl::MakeConstSpan(value_pages).subspan(0, 2);
    const absl::Status status = engine_->AttendPaged({&apart, 1});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("2 value pages for 150 tokens"),
              std::string::npos)
        << status;
  }
}

// The paged kernel polls its stop check between units and every 1,024 keys
// of one: a check that says stop on its third poll ends the call with its
// error; one that never does changes nothing.
TEST_P(PagedAttentionTest, StopCheckEndsTheCallWithItsError) {
  Item item = Make({8, 2, 1, 8192, 64, 64, 64, DataType::kBFloat16,
                    Precision::kFloat32, false},
                   13);
  PagedAttend paged = ToPaged(item, 0.125f);
  ASSERT_TRUE(engine_->AttendPaged({&paged, 1}).ok());
  const std::vector<float> plain = item.output;
  std::atomic<int64_t> polls{0};
  const StopCheck never = [&polls] {
    polls.fetch_add(1);
    return absl::OkStatus();
  };
  ASSERT_TRUE(engine_->AttendPaged({&paged, 1}, never).ok());
  EXPECT_EQ(item.output, plain);
  // Each unit at its start, and within it every 1,024 of 16,384 keys.
  EXPECT_GE(polls.load(), 16);
  polls = 0;
  const StopCheck third = [&polls]() -> absl::Status {
    if (polls.fetch_add(1) + 1 >= 3) {
      return absl::DeadlineExceededError("stopped by the test");
    }
    return absl::OkStatus();
  };
  const absl::Status status = engine_->AttendPaged({&paged, 1}, third);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_EQ(status.message(), "stopped by the test");
  EXPECT_LT(polls.load(), 16);
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, PagedAttentionTest,
    ::testing::Combine(::testing::Values(Code::kNative, Code::kAvx2,
                                         Code::kPortable),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<Code, bool>>& param) {
      const Code code = std::get<0>(param.param);
      return std::string(code == Code::kNative ? "Native"
                         : code == Code::kAvx2 ? "Avx2"
                                               : "Portable") +
             (std::get<1>(param.param) ? "KeysByDimension" : "KeysAsRows");
    });

}  // namespace
}  // namespace attnserve
