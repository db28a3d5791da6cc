// --weights_dir: folders of .npy files (float32 or float64) and a config.txt,
// registered at start and matching the naive reference, and the start
// failures that name a broken folder or a missing directory.
#include <openssl/sha.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/server/server.h"
#include "attnserve/server/weights/weights_dir_watcher.h"
#include "attnserve/server/weights/weights_registry.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/metrics_scrape.h"
#include "server/server_fixture.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::Biases;
using ::attnserve::testing::ExpectDims;
using ::attnserve::testing::Expected;
using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kAbs;
using ::attnserve::testing::kRel;
using ::attnserve::testing::kTimeout;
using ::attnserve::testing::MakeRequest;
using ::attnserve::testing::MakeWeights;
using ::attnserve::testing::NamesOf;
using ::attnserve::testing::NpyBytes;
using ::attnserve::testing::RandomTensor;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ServerFixture;
using ::attnserve::testing::ValuesOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class WeightsDirTest : public ServerFixture {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            absl::StrCat(
                "weights_test_",
                ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                "_", getpid());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }

  void TearDown() override {
    std::error_code error;
    std::filesystem::remove_all(root_, error);
  }

  static void WriteFile(const std::filesystem::path& path,
                        const std::string& contents) {
    ASSERT_TRUE(::attnserve::testing::WriteFile(path, contents)) << path;
  }

  // Writes `weights` as folder `name` of root_: config.txt and one .npy per
  // tensor present.
  void WriteFolder(const std::string& name, const std::string& config,
                   const v1::ProjectionWeights& weights,
                   const std::string& descr) {
    ASSERT_TRUE(::attnserve::testing::WriteWeightsFolder(root_ / name, config,
                                                         weights, descr));
  }

  // The registered sets and their versions (empty if ListWeights fails).
  std::map<std::string, int64_t> Versions() {
    std::map<std::string, int64_t> found;
    absl::StatusOr<v1::ListWeightsResponse> list =
        client_->ListWeights(kTimeout);
    if (list.ok()) {
      for (const v1::WeightsInfo& info : list->weights()) {
        found[info.name()] = info.version();
      }
    }
    return found;
  }

  std::filesystem::path root_;
};

TEST_F(WeightsDirTest, NpyHelperWritesAlignedVersionOneHeader) {
  const std::string bytes = NpyBytes("<f4", {8, 4}, std::vector<float>(32));
  ASSERT_GT(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_length = static_cast<unsigned char>(bytes[8]) |
                               (static_cast<unsigned char>(bytes[9]) << 8);
  EXPECT_EQ((10 + header_length) % 64, 0u);
  EXPECT_EQ(bytes[10 + header_length - 1], '\n');
  EXPECT_EQ(bytes.size(), 10 + header_length + 32 * sizeof(float));
  EXPECT_THAT(bytes.substr(10, header_length),
              HasSubstr("{'descr': '<f4', 'fortran_order': False, "
                        "'shape': (8, 4), }"));
}

TEST_F(WeightsDirTest, FoldersAreRegisteredAtStartAndMatchReference) {
  // "tiny": E = 4, H = Hkv = 2, Dk = 4, Dv = 3, b_q only; w_q is (8, 4).
  const ReferenceMhaShape tiny{2, 3, 3, 4, 4, 2, 2, 4, 3};
  v1::ProjectionWeights tiny_weights = MakeWeights(tiny, 500, Biases::kNone);
  *tiny_weights.mutable_b_q() = RandomTensor(v1::FLOAT32, {8}, 505, 0.5f);
  WriteFolder("tiny", "num_heads=2\n", tiny_weights, "<f4");
  // "gqa64": float64 files, grouped-query, Ekv != E, a comment in config.txt.
  const ReferenceMhaShape gqa{2, 3, 4, 6, 5, 4, 2, 2, 2};
  const v1::ProjectionWeights gqa_weights = MakeWeights(gqa, 600);
  WriteFolder("gqa64", "# grouped-query\nnum_heads=4\nnum_kv_heads=2\n",
              gqa_weights, "<f8");
  WriteFile(root_ / "README.txt", "not a folder: ignored\n");
  if (HasFatalFailure()) return;

  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  StartServer(options);
  if (HasFatalFailure()) return;
  EXPECT_THAT(server_->startup_weights(), ElementsAre("demo", "gqa64", "tiny"));

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo", "gqa64", "tiny"));
  ExpectDims(list->weights(1), gqa, /*has_bias=*/true);
  ExpectDims(list->weights(2), tiny, /*has_bias=*/true);

  for (const bool cross : {false, true}) {
    SCOPED_TRACE(cross ? "tiny, cross-attention" : "tiny, self-attention");
    ReferenceMhaShape s = tiny;
    if (cross) s.key_len = 5;
    v1::MultiHeadAttentionRequest request = MakeRequest(s, 700, cross);
    request.set_weights_name("tiny");
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->weights_version(), list->weights(2).version());
    ExpectNear(response->output(), Expected(s, request, tiny_weights).output,
               kAbs, kRel, "output");
  }

  v1::MultiHeadAttentionRequest request = MakeRequest(gqa, 800, true);
  request.set_weights_name("gqa64");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(gqa, request, gqa_weights).output,
             kAbs, kRel, "gqa64 output");
}

// A folder's config.txt may carry RoPE: the set registers with it, and a call
// by name rotates (at explicit positions too).
TEST_F(WeightsDirTest, AFolderCarriesItsRope) {
  const ReferenceMhaShape llama{1, 5, 5, 8, 8, 4, 2, 4, 4};
  v1::ProjectionWeights weights = MakeWeights(llama, 510, Biases::kNone);
  weights.set_num_kv_heads(2);
  WriteFolder("llama",
              "num_heads=4\nnum_kv_heads=2\nrope_theta=500000\n"
              "rotary_dim=2\nrope_interleaved=1\n",
              weights, "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  StartServer(options);
  if (HasFatalFailure()) return;
  EXPECT_THAT(server_->startup_weights(), ElementsAre("demo", "llama"));
  weights.mutable_rope()->set_theta(500000.0f);
  weights.mutable_rope()->set_rotary_dim(2);
  weights.mutable_rope()->set_interleaved(true);
  for (const bool positions : {false, true}) {
    v1::MultiHeadAttentionRequest request = MakeRequest(llama, 720, false);
    request.set_weights_name("llama");
    request.mutable_options()->set_causal(true);
    for (int64_t i = 0; positions && i < 5; ++i) {
      request.mutable_options()->add_query_positions(1000 + 3 * i);
      request.mutable_options()->add_key_positions(1000 + 3 * i);
    }
    absl::StatusOr<v1::MultiHeadAttentionResponse> response =
        client_->MultiHeadAttention(request, kTimeout);
    ASSERT_TRUE(response.ok()) << response.status();
    ExpectNear(response->output(), Expected(llama, request, weights).output,
               kAbs, kRel, positions ? "explicit positions" : "0 to L - 1");
  }
}

// The version a folder registers under is its config.txt's version=N, or one
// derived from its contents: two servers reading the same folder agree.
TEST_F(WeightsDirTest, VersionsComeFromTheFolderSoReplicasAgree) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("pinned", "num_heads=2\nversion=7\n", MakeWeights(tiny, 400),
              "<f4");
  WriteFolder("derived", "num_heads=2\n", MakeWeights(tiny, 410), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  StartServer(options);
  if (HasFatalFailure()) return;
  absl::StatusOr<std::unique_ptr<AttnServer>> other =
      AttnServer::Start(options);
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<std::unique_ptr<Client>> other_client =
      Client::Connect(absl::StrCat("127.0.0.1:", (*other)->port()));
  ASSERT_TRUE(other_client.ok()) << other_client.status();
  absl::StatusOr<v1::ListWeightsResponse> first =
      client_->ListWeights(kTimeout);
  absl::StatusOr<v1::ListWeightsResponse> second =
      (*other_client)->ListWeights(kTimeout);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_THAT(NamesOf(*first), ElementsAre("derived", "pinned"));
  ASSERT_THAT(NamesOf(*second), ElementsAre("derived", "pinned"));
  EXPECT_EQ(first->weights(1).version(), 7);
  EXPECT_EQ(second->weights(1).version(), 7);
  EXPECT_GT(first->weights(0).version(), 0);
  EXPECT_EQ(first->weights(0).version(), second->weights(0).version());
}

// Two replicas at two versions of a set (one reload ahead of the other): a
// call pinned to the newer version is retried on FAILED_PRECONDITION, so
// round_robin takes it to the replica holding it, unless the policy says not.
TEST_F(WeightsDirTest, ACallPinnedToAVersionIsRetriedOnAnotherReplica) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  const std::filesystem::path ahead = root_ / "ahead";
  WriteFolder("behind/layer", "num_heads=2\nversion=7\n",
              MakeWeights(tiny, 420), "<f4");
  ASSERT_TRUE(::attnserve::testing::WriteWeightsFolder(
      ahead / "layer", "num_heads=2\nversion=8\n", MakeWeights(tiny, 421),
      "<f4"));
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = (root_ / "behind").string();
  StartServer(options);
  if (HasFatalFailure()) return;
  options.weights_dir = ahead.string();
  absl::StatusOr<std::unique_ptr<AttnServer>> other =
      AttnServer::Start(options);
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string target = absl::StrCat("ipv4:127.0.0.1:", server_->port(),
                                          ",127.0.0.1:", (*other)->port());
  v1::MultiHeadAttentionRequest request = MakeRequest(tiny, 422, false);
  request.set_weights_name("layer");
  request.set_weights_version(8);
  for (const bool retried : {true, false}) {
    SCOPED_TRACE(retried ? "retried" : "not retried");
    ClientOptions client_options;
    // More than two: a first call may find one replica connected only.
    client_options.retry.max_attempts = 4;
    client_options.retry.retry_weights_version = retried;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(target, client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    int refused = 0;
    for (int call = 0; call < 8; ++call) {
      absl::StatusOr<v1::MultiHeadAttentionResponse> response =
          (*client)->MultiHeadAttention(request, kTimeout);
      if (response.ok()) {
        EXPECT_EQ(response->weights_version(), 8);
        continue;
      }
      EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition)
          << response.status();
      ++refused;
    }
    if (retried) {
      EXPECT_EQ(refused, 0);
    } else {
      EXPECT_GT(refused, 0);
    }
  }
}

// Waits up to 30 s for `done`, polling every 20 ms.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time by = absl::Now() + absl::Seconds(30);
  while (!done()) {
    if (absl::Now() > by) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// A running server keeps up with the folder: sets added appear, a changed set
// is registered at its new version (and a request may insist on a version),
// a removed set goes, and a set whose folder breaks keeps its last good
// version.
TEST_F(WeightsDirTest, ReloadsAddedChangedRemovedAndBrokenSets) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  // "tiny" is a link to a hidden folder, swapped atomically for another as a
  // Kubernetes volume update does.
  WriteFolder(".tiny.1", "num_heads=2\nversion=1\n", MakeWeights(tiny, 420),
              "<f4");
  std::filesystem::create_directory_symlink(".tiny.1", root_ / "tiny");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  options.weights_reload_interval = absl::Milliseconds(50);
  options.metrics_port = 0;
  StartServer(options);
  if (HasFatalFailure()) return;
  const auto versions = [this] { return Versions(); };
  EXPECT_EQ(versions(), (std::map<std::string, int64_t>{{"tiny", 1}}));

  // Added (written apart, then renamed in whole).
  WriteFolder(".second", "num_heads=2\nversion=3\n", MakeWeights(tiny, 430),
              "<f4");
  std::filesystem::rename(root_ / ".second", root_ / "second");
  EXPECT_TRUE(Eventually([&] { return versions().count("second") == 1; }));
  // Changed: written apart, then the link swapped.
  const v1::ProjectionWeights changed = MakeWeights(tiny, 440);
  WriteFolder(".tiny.2", "num_heads=2\nversion=2\n", changed, "<f4");
  std::filesystem::create_directory_symlink(".tiny.2", root_ / ".tiny.link");
  std::filesystem::rename(root_ / ".tiny.link", root_ / "tiny");
  EXPECT_TRUE(Eventually([&] { return versions()["tiny"] == 2; }));
  v1::MultiHeadAttentionRequest request = MakeRequest(tiny, 450, false);
  request.set_weights_name("tiny");
  request.set_weights_version(2);
  absl::StatusOr<v1::MultiHeadAttentionResponse> answer =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->weights_version(), 2);
  ExpectNear(answer->output(), Expected(tiny, request, changed).output, kAbs,
             kRel, "the new version's output");
  request.set_weights_version(1);
  const absl::Status stale =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()),
              HasSubstr("weights_name 'tiny' is at version 2 on this server, "
                        "the request's weights_version is 1"));
  // Removed.
  std::filesystem::remove_all(root_ / "second");
  EXPECT_TRUE(Eventually([&] { return versions().count("second") == 0; }));
  // Broken: the last good version stays.
  const auto samples = [this](const std::string& key) {
    const auto found = ::attnserve::testing::Samples(
        ::attnserve::testing::Scrape(server_->metrics_port()));
    const auto it = found.find(key);
    return it == found.end() ? -1.0 : it->second;
  };
  const std::string failed =
      R"(attnserve_weights_dir_changes_total{change="failed"})";
  EXPECT_EQ(samples(failed), 0);
  WriteFile(root_ / ".tiny.2" / "config.txt", "num_heads=two\n");
  EXPECT_TRUE(Eventually([&] { return samples(failed) >= 1; }));
  EXPECT_EQ(versions(), (std::map<std::string, int64_t>{{"tiny", 2}}));
  EXPECT_EQ(
      samples(R"(attnserve_weights_dir_changes_total{change="registered"})"),
      2);
  EXPECT_EQ(samples(R"(attnserve_weights_dir_changes_total{change="removed"})"),
            1);
}

// While the server runs, an entry the folder may not hold (a link out of
// weights_dir, in a set's folder or at the top) fails alone: that set keeps
// its last good version, and the other sets still follow their folders.
TEST_F(WeightsDirTest, ABadEntryFailsAloneWhileTheServerRuns) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("a", "num_heads=2\nversion=1\n", MakeWeights(tiny, 460), "<f4");
  WriteFolder("b", "num_heads=2\nversion=1\n", MakeWeights(tiny, 461), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  options.weights_reload_interval = absl::Milliseconds(50);
  options.metrics_port = 0;
  StartServer(options);
  if (HasFatalFailure()) return;
  const auto versions = [this] { return Versions(); };
  ASSERT_EQ(versions(), (std::map<std::string, int64_t>{{"a", 1}, {"b", 1}}));
  const std::filesystem::path outside = root_.parent_path();
  std::filesystem::create_symlink(outside, root_ / "a" / "escape");
  std::filesystem::create_symlink(outside, root_ / "stray");
  // Changed and added beside them.
  WriteFolder(".b", "num_heads=2\nversion=2\n", MakeWeights(tiny, 462), "<f4");
  std::filesystem::remove_all(root_ / "b");
  std::filesystem::rename(root_ / ".b", root_ / "b");
  WriteFolder("c", "num_heads=2\nversion=3\n", MakeWeights(tiny, 463), "<f4");
  EXPECT_TRUE(Eventually([&] {
    return versions() ==
           std::map<std::string, int64_t>{{"a", 1}, {"b", 2}, {"c", 3}};
  })) << "a, b, c at "
      << versions()["a"] << ", " << versions()["b"] << ", " << versions()["c"];
  // The two refused entries are counted once each, not at every look (ten
  // more looks here) while they stay.
  absl::SleepFor(absl::Milliseconds(500));
  const auto found = ::attnserve::testing::Samples(
      ::attnserve::testing::Scrape(server_->metrics_port()));
  const auto failed =
      found.find(R"(attnserve_weights_dir_changes_total{change="failed"})");
  ASSERT_NE(failed, found.end());
  EXPECT_EQ(failed->second, 2);
}

// weights_version is checked like any field.
TEST_F(WeightsDirTest, WeightsVersionNeedsAPositiveVersionAndAName) {
  StartServer(DefaultOptions());
  if (HasFatalFailure()) return;
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  v1::MultiHeadAttentionRequest request = MakeRequest(tiny, 460, false);
  *request.mutable_weights() = MakeWeights(tiny, 470);
  request.set_weights_version(3);
  absl::Status status = client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("weights_version is 3, expected 0, or a positive "
                        "version with weights_name"));
  request.set_weights_name("demo");
  request.set_weights_version(-1);
  status = client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

// With demo_weights off only weights_dir's sets answer; `demo` is not found.
TEST_F(WeightsDirTest, DemoWeightsOffRegistersOnlyTheFolders) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("tiny", "num_heads=2\n", MakeWeights(tiny, 950), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  StartServer(options);
  if (HasFatalFailure()) return;
  EXPECT_THAT(server_->startup_weights(), ElementsAre("tiny"));
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("tiny"));
  v1::MultiHeadAttentionRequest request = MakeRequest(tiny, 960, false);
  request.set_weights_name("demo");
  EXPECT_EQ(client_->MultiHeadAttention(request, kTimeout).status().code(),
            absl::StatusCode::kNotFound);
}

// weights_dir pointed at one set's folder, the layout `attnctl --weights_dir`
// takes, fails naming the folder to use instead of starting without the set.
TEST_F(WeightsDirTest, OneSetsFolderFailsStartNamingItsParent) {
  const ReferenceMhaShape tiny{1, 1, 1, 4, 4, 2, 2, 4, 4};
  WriteFolder("tiny", "num_heads=2\n", MakeWeights(tiny, 970), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.weights_dir = (root_ / "tiny").string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
      << server.status();
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("it is one weight set's folder; expected the folder "
                        "holding one folder per weight set"));
}

TEST_F(WeightsDirTest, FolderWithoutConfigFailsStartNamingTheFolder) {
  const ReferenceMhaShape tiny{1, 1, 1, 4, 4, 2, 2, 4, 4};
  WriteFolder("broken", /*config=*/"", MakeWeights(tiny, 900), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound)
      << server.status();
  const std::string message(server.status().message());
  EXPECT_THAT(message, HasSubstr((root_ / "broken").string()));
  EXPECT_THAT(message, HasSubstr("config.txt is missing"));
}

// A folder changed while its config.txt keeps its version=N is registered
// again at N: its contents, not its version, tell whether it changed (a
// server started afterwards reads the new weights; this one must agree).
TEST_F(WeightsDirTest, NewWeightsUnderTheSameVersionAreServed) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("same", "num_heads=2\nversion=5\n", MakeWeights(tiny, 470),
              "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  options.weights_reload_interval = absl::Milliseconds(50);
  StartServer(options);
  if (HasFatalFailure()) return;
  const v1::ProjectionWeights changed = MakeWeights(tiny, 471);
  WriteFolder(".same", "num_heads=2\nversion=5\n", changed, "<f4");
  std::filesystem::remove_all(root_ / "same");
  std::filesystem::rename(root_ / ".same", root_ / "same");
  v1::MultiHeadAttentionRequest request = MakeRequest(tiny, 472, false);
  request.set_weights_name("same");
  const std::vector<double> expected = Expected(tiny, request, changed).output;
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<v1::MultiHeadAttentionResponse> answer =
        client_->MultiHeadAttention(request, kTimeout);
    if (!answer.ok() || answer->weights_version() != 5) return false;
    const std::vector<float> got = ValuesOf(answer->output());
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::abs(got[i] - expected[i]) > 1e-4) return false;
    }
    return got.size() == expected.size();
  }));
}

// A folder changed after its files were read and before they are registered
// (a swap in the middle of a read may give files of two versions) is not
// registered from that read: at start-up it is read again, and a running
// scan keeps the last good version until the next look.
TEST_F(WeightsDirTest, AFolderChangedDuringItsReadIsNotRegisteredFromIt) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("tiny", "num_heads=2\nversion=1\n", MakeWeights(tiny, 930),
              "<f4");
  if (HasFatalFailure()) return;
  WeightsRegistry registry(int64_t{1} << 24);
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  // Rewrites the folder (a config.txt of another size) on the first
  // `changes` reads after it is set.
  int changes = 0;
  int64_t next_version = 0;
  watcher.SetAfterReadForTesting([&](const std::string& folder) {
    if (changes == 0) return;
    --changes;
    WriteFolder(std::filesystem::path(folder).filename().string(),
                absl::StrCat("num_heads=2\nversion=", next_version, "\n"),
                MakeWeights(tiny, 931), "<f4");
  });
  const auto version = [&registry] {
    const absl::StatusOr<WeightsRegistry::Entry> entry = registry.Get("tiny");
    return entry.ok() ? entry->version : int64_t{-1};
  };

  // Start-up: changed during the first read, registered from the second.
  changes = 1;
  next_version = 22;
  const absl::StatusOr<std::vector<std::string>> loaded = watcher.LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(version(), 22);
  EXPECT_EQ(changes, 0);

  // A scan: version 3 written, changed to 444 while it is read. Nothing is
  // registered from that read; the next scan registers 444.
  WriteFolder("tiny", "num_heads=2\nversion=3\n", MakeWeights(tiny, 932),
              "<f4");
  changes = 1;
  next_version = 444;
  WeightsDirWatcher::Changes scan = watcher.Scan();
  EXPECT_EQ(scan.failed, 1);
  EXPECT_EQ(scan.registered, 0);
  EXPECT_EQ(version(), 22);
  scan = watcher.Scan();
  EXPECT_EQ(scan.failed, 0);
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(version(), 444);

  // A folder that changes at every read fails start-up after a few reads,
  // naming it.
  WeightsRegistry fresh(int64_t{1} << 24);
  WeightsDirWatcher restless(root_.string(), int64_t{1} << 20, &fresh, nullptr);
  int reads = 0;
  restless.SetAfterReadForTesting([&](const std::string& folder) {
    ++reads;
    WriteFolder(std::filesystem::path(folder).filename().string(),
                absl::StrCat("num_heads=2\nversion=", 10 * reads, "\n"),
                MakeWeights(tiny, 933), "<f4");
  });
  const absl::StatusOr<std::vector<std::string>> refused = restless.LoadAll();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("tiny: it changed while it was read"));
  EXPECT_EQ(reads, 3);
  EXPECT_FALSE(fresh.Get("tiny").ok());
}

// The watcher looks again at a folder whose files only changed mode or owner
// (a file that could not be read until chmod fixed it, F3 of the 2026-12-06
// audit: it stayed unread until touched), and a set folder's link swapped to
// a target not there yet keeps its set (it was deleted, though the log said
// kept), then follows the target once it comes.
TEST_F(WeightsDirTest, AChmodIsLookedAtAndALinkMidSwapKeepsItsSet) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder(".tiny.1", "num_heads=2\nversion=1\n", MakeWeights(tiny, 950),
              "<f4");
  std::filesystem::create_directory_symlink(".tiny.1", root_ / "tiny");
  if (HasFatalFailure()) return;
  WeightsRegistry registry(int64_t{1} << 24);
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  int reads = 0;
  watcher.SetAfterReadForTesting([&](const std::string&) { ++reads; });
  ASSERT_TRUE(watcher.LoadAll().ok());
  ASSERT_EQ(reads, 1);
  watcher.Scan();
  EXPECT_EQ(reads, 1);  // Unchanged: not read.
  std::filesystem::permissions(
      root_ / ".tiny.1" / "w_q.npy",
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  WeightsDirWatcher::Changes scan = watcher.Scan();
  EXPECT_EQ(reads, 2);
  EXPECT_EQ(scan.registered, 0);  // The same weights: nothing new.

  std::filesystem::create_directory_symlink(".tiny.2", root_ / ".tiny.link");
  std::filesystem::rename(root_ / ".tiny.link", root_ / "tiny");
  scan = watcher.Scan();
  EXPECT_EQ(scan.removed, 0);
  EXPECT_EQ(scan.failed, 1);
  ASSERT_TRUE(registry.Get("tiny").ok());
  EXPECT_EQ(registry.Get("tiny")->version, 1);
  WriteFolder(".tiny.2", "num_heads=2\nversion=2\n", MakeWeights(tiny, 951),
              "<f4");
  scan = watcher.Scan();
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(registry.Get("tiny")->version, 2);
  // A link out of weights_dir keeps the set too.
  std::filesystem::create_directory_symlink(root_.parent_path(),
                                            root_ / ".tiny.out");
  std::filesystem::rename(root_ / ".tiny.out", root_ / "tiny");
  scan = watcher.Scan();
  EXPECT_EQ(scan.removed, 0);
  EXPECT_EQ(registry.Get("tiny")->version, 2);
}

// A set's link swapped, over and over, between its folder and a loop: a
// look may find it a folder when checked and a loop when its type is asked.
// directory_entry::is_directory() threw filesystem_error there, on the
// watcher's thread, and the process ended (until 2026-12-07); the entry is
// now refused for that look and its set kept.
TEST_F(WeightsDirTest, ALinkSwappedDuringALookNeverEndsTheProcess) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder(".tiny.1", "num_heads=2\nversion=1\n", MakeWeights(tiny, 960),
              "<f4");
  if (HasFatalFailure()) return;
  std::filesystem::create_directory_symlink(".tiny.1", root_ / "tiny");
  WeightsRegistry registry(int64_t{1} << 24);
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  ASSERT_TRUE(watcher.LoadAll().ok());
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    std::error_code error;
    for (int i = 0; i < 200000 && !stop; ++i) {
      // "tiny" -> "tiny" is a loop; "tiny" -> ".tiny.1" the set.
      const std::filesystem::path next = root_ / ".tiny.next";
      std::filesystem::remove(next, error);
      std::filesystem::create_directory_symlink(i % 2 ? ".tiny.1" : "tiny",
                                                next, error);
      std::filesystem::rename(next, root_ / "tiny", error);
    }
  });
  int64_t looks = 0, refusals = 0;
  const absl::Time until = absl::Now() + absl::Seconds(2);
  while (absl::Now() < until && looks < 20000) {
    try {
      const WeightsDirWatcher::Changes changes = watcher.Scan();
      refusals += changes.failed;
      EXPECT_EQ(changes.removed, 0);
    } catch (const std::exception& error) {
      ADD_FAILURE() << "look " << looks << " threw: " << error.what();
      break;
    }
    ++looks;
  }
  stop = true;
  swapper.join();
  std::filesystem::remove(root_ / "tiny");
  std::filesystem::create_directory_symlink(".tiny.1", root_ / "tiny");
  watcher.Scan();
  ASSERT_TRUE(registry.Get("tiny").ok());
  EXPECT_EQ(registry.Get("tiny")->version, 1);
  std::cout << looks << " looks, " << refusals << " refused the link\n";
}

// A config.txt that keeps its version while the weights change: the set is
// registered again, and counted (the registry's bytes, and the metrics that
// show them, moved; until 2026-12-07 nothing counted it, so they were not
// updated).
TEST_F(WeightsDirTest, NewWeightsUnderTheSameVersionAreCounted) {
  const ReferenceMhaShape small{1, 2, 2, 4, 4, 2, 2, 4, 4};
  const ReferenceMhaShape large{1, 2, 2, 8, 8, 2, 2, 4, 4};
  WriteFolder("kept", "num_heads=2\nversion=7\n", MakeWeights(small, 970),
              "<f4");
  if (HasFatalFailure()) return;
  WeightsRegistry registry(int64_t{1} << 24);
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  ASSERT_TRUE(watcher.LoadAll().ok());
  const int64_t before = registry.List("", 0).total_bytes;
  WriteFolder(".kept", "num_heads=2\nversion=7\n", MakeWeights(large, 971),
              "<f4");
  if (HasFatalFailure()) return;
  std::filesystem::remove_all(root_ / "kept");
  std::filesystem::rename(root_ / ".kept", root_ / "kept");
  const WeightsDirWatcher::Changes changes = watcher.Scan();
  EXPECT_EQ(changes.registered, 1);
  EXPECT_EQ(registry.Get("kept")->version, 7);
  EXPECT_GT(registry.List("", 0).total_bytes, before);
  // Touched, the same weights: not registered again, not counted.
  std::filesystem::last_write_time(
      root_ / "kept" / "w_q.npy",
      std::filesystem::last_write_time(root_ / "kept" / "w_q.npy") +
          std::chrono::seconds(1));
  EXPECT_EQ(watcher.Scan().registered, 0);
}

// weights_dir itself gone or not a folder is reported and counted once while
// it stays so (it was at every look: 360 an hour at the default interval),
// and again once it changes.
TEST_F(WeightsDirTest, AFolderGoneIsCountedOnceWhileItStaysGone) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("tiny", "num_heads=2\nversion=1\n", MakeWeights(tiny, 960),
              "<f4");
  if (HasFatalFailure()) return;
  WeightsRegistry registry(int64_t{1} << 24);
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  ASSERT_TRUE(watcher.LoadAll().ok());
  const std::filesystem::path away = root_.string() + ".away";
  std::filesystem::rename(root_, away);
  EXPECT_EQ(watcher.Scan().failed, 1);
  EXPECT_EQ(watcher.Scan().failed, 0);
  EXPECT_EQ(watcher.Scan().failed, 0);
  WriteFile(root_, "a file now");
  EXPECT_EQ(watcher.Scan().failed, 1);  // Another failure.
  EXPECT_EQ(watcher.Scan().failed, 0);
  std::filesystem::remove(root_);
  std::filesystem::rename(away, root_);
  EXPECT_EQ(watcher.Scan().failed, 0);
  EXPECT_EQ(registry.Get("tiny")->version, 1);  // Kept throughout.
  std::filesystem::rename(root_, away);
  EXPECT_EQ(watcher.Scan().failed, 1);  // Gone again: reported again.
  std::filesystem::rename(away, root_);
}

// A float64 file may be larger than --max_weights_bytes when the set it
// converts into fits (it was refused as a file over the limit, though the
// same weights were put by PutWeights).
TEST_F(WeightsDirTest, AFloat64FileOverTheLimitLoadsWhenItsSetFits) {
  // w_k [64, 256] dominates: 131 KB of float64, 65.5 KB once converted.
  const ReferenceMhaShape lopsided{1, 1, 1, 1, 256, 1, 1, 64, 1};
  WriteFolder("big", "num_heads=1\n", MakeWeights(lopsided, 970), "<f8");
  if (HasFatalFailure()) return;
  const int64_t file = static_cast<int64_t>(
      std::filesystem::file_size(root_ / "big" / "w_k.npy"));
  const int64_t limit = file * 3 / 4;
  WeightsRegistry registry(limit);
  WeightsDirWatcher watcher(root_.string(), limit, &registry, nullptr);
  const absl::StatusOr<std::vector<std::string>> loaded = watcher.LoadAll();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(registry.Get("big").ok());
}

// The version a folder's set gets from its contents is the first 56 bits of
// the SHA-256 of the weights' deterministic serialisation, as every release
// has derived it (replicas of two releases agree), computed without
// serialising the message: protobuf serialises nothing over 2 GiB, and every
// such set had the digest of nothing (the 2026-12-06 audit, F1), so a
// changed set was never registered.
int64_t Sha256Version(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
         digest);
  int64_t version = 0;
  for (int i = 0; i < 7; ++i) version = (version << 8) | digest[i];
  return version > 0 ? version : 1;
}

TEST(WeightsDigestTest, IsTheSha256OfTheWeightsSerialisation) {
  const ReferenceMhaShape shape{1, 2, 2, 8, 6, 4, 2, 4, 3};
  for (const Biases biases : {Biases::kAll, Biases::kNone}) {
    v1::PutWeightsRequest request;
    *request.mutable_weights() = MakeWeights(shape, 980, biases);
    if (biases == Biases::kAll) {
      request.mutable_weights()->mutable_rope()->set_theta(500000.0f);
      request.mutable_weights()->mutable_rope()->set_interleaved(true);
    }
    std::string serialised;
    {
      google::protobuf::io::StringOutputStream stream(&serialised);
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.SetSerializationDeterministic(true);
      ASSERT_TRUE(request.weights().SerializeToCodedStream(&coded));
    }
    const absl::StatusOr<int64_t> digest = WeightsDigest(request);
    ASSERT_TRUE(digest.ok()) << digest.status();
    EXPECT_EQ(*digest, Sha256Version(serialised));
  }
}

TEST(WeightsDigestTest, FollowsTheBytesOfASetOver2GiB) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer shadows each byte written with four: 10 GB for this one
  // thread's hashing, which has no thread to check.
  GTEST_SKIP() << "2 GiB of weights under ThreadSanitizer";
#endif
  v1::PutWeightsRequest request;
  v1::Tensor& big = *request.mutable_weights()->mutable_w_k();
  big.set_dtype(v1::FLOAT16);
  big.add_shape(int64_t{1} << 15);
  big.add_shape((int64_t{1} << 15) + 16);
  big.mutable_data()->assign(
      static_cast<size_t>(big.shape(0) * big.shape(1) * 2), '\1');
  request.mutable_weights()->set_num_heads(1);
  const absl::StatusOr<int64_t> before = WeightsDigest(request);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_NE(*before, Sha256Version(""));
  (*big.mutable_data())[big.data().size() - 1] = '\2';
  const absl::StatusOr<int64_t> after = WeightsDigest(request);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE(*after, *before);
}

// A set refused for want of room in --max_weights_bytes is read again, its
// folder unchanged, once room is freed (by a set removed in the same look
// here), not at every look while there is none: replicas that started with
// the room would otherwise serve it while this one answered NOT_FOUND.
TEST_F(WeightsDirTest, ASetRefusedForRoomLoadsOnceRoomIsFreed) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  WriteFolder("a", "num_heads=2\nversion=1\n", MakeWeights(tiny, 940), "<f4");
  WriteFolder("b", "num_heads=2\nversion=1\n", MakeWeights(tiny, 941), "<f4");
  if (HasFatalFailure()) return;
  // Room for one of them (2,128 bytes each).
  WeightsRegistry registry(3000);
  int reads = 0;
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  watcher.SetAfterReadForTesting([&reads](const std::string&) { ++reads; });
  WeightsDirWatcher::Changes scan = watcher.Scan();
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(scan.failed, 1);
  EXPECT_TRUE(registry.Get("a").ok());
  EXPECT_FALSE(registry.Get("b").ok());
  EXPECT_EQ(reads, 2);
  scan = watcher.Scan();
  EXPECT_EQ(scan.failed, 0);
  EXPECT_EQ(reads, 2);

  std::filesystem::remove_all(root_ / "a");
  scan = watcher.Scan();
  EXPECT_EQ(scan.removed, 1);
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(scan.failed, 0);
  EXPECT_FALSE(registry.Get("a").ok());
  const absl::StatusOr<WeightsRegistry::Entry> b = registry.Get("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->version, 1);
  EXPECT_EQ(reads, 3);
}

// A set larger than the whole limit is not read again each time the registry
// shrinks (it would fail again, and be counted and logged again): only once
// its folder changes.
TEST_F(WeightsDirTest, ASetOverTheWholeLimitWaitsForItsFolderToChange) {
  const ReferenceMhaShape tiny{1, 2, 2, 4, 4, 2, 2, 4, 4};
  const ReferenceMhaShape wide{1, 2, 2, 16, 16, 2, 2, 8, 8};
  WriteFolder("a", "num_heads=2\nversion=1\n", MakeWeights(tiny, 950), "<f4");
  WriteFolder("big", "num_heads=2\nversion=1\n",
              MakeWeights(wide, 951, Biases::kNone), "<f4");
  if (HasFatalFailure()) return;
  WeightsRegistry registry(3000);  // Room for a (2,128 bytes), never big.
  int reads = 0;
  WeightsDirWatcher watcher(root_.string(), int64_t{1} << 20, &registry,
                            nullptr);
  watcher.SetAfterReadForTesting([&reads](const std::string&) { ++reads; });
  WeightsDirWatcher::Changes scan = watcher.Scan();
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(scan.failed, 1);
  EXPECT_EQ(reads, 2);

  std::filesystem::remove_all(root_ / "a");
  scan = watcher.Scan();
  EXPECT_EQ(scan.removed, 1);
  EXPECT_EQ(scan.failed, 0);
  EXPECT_EQ(reads, 2);
  EXPECT_EQ(registry.List("", 0).total_bytes, 0);

  WriteFolder("big", "num_heads=2\nversion=2\n", MakeWeights(tiny, 952), "<f4");
  if (HasFatalFailure()) return;
  scan = watcher.Scan();
  EXPECT_EQ(scan.registered, 1);
  EXPECT_EQ(scan.failed, 0);
  EXPECT_EQ(reads, 3);
  const absl::StatusOr<WeightsRegistry::Entry> big = registry.Get("big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->version, 2);
}

// A set whose files hold more than twice max_weights_bytes (each file under
// it) is refused from the files' sizes, before any of it is read.
TEST_F(WeightsDirTest, AFolderTooLargeIsRefusedBeforeItIsRead) {
  // E 64, H 8 x 8: each weight 64 x 64 f32, 16 KiB and a header; four of
  // them, 64 KiB in all, against a limit of 30,000 bytes.
  const ReferenceMhaShape shape{1, 1, 1, 64, 64, 8, 8, 8, 8};
  WriteFolder("big", "num_heads=8\n", MakeWeights(shape, 910, Biases::kNone),
              "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.weights_dir = root_.string();
  options.memory.max_weights_bytes = 30000;
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted)
      << server.status();
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("more than twice max_weights_bytes (30000)"));
}

// RoPE's rotary_dim or rope_interleaved without rope_theta would be dropped
// (a set with no RoPE): refused, naming the file.
TEST_F(WeightsDirTest, RopeKeysWithoutThetaFailStart) {
  const ReferenceMhaShape tiny{1, 1, 1, 4, 4, 2, 2, 4, 4};
  WriteFolder("rope", "num_heads=2\nrotary_dim=2\nrope_interleaved=1\n",
              MakeWeights(tiny, 920), "<f4");
  if (HasFatalFailure()) return;
  ServerOptions options = DefaultOptions();
  options.weights_dir = root_.string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("sets rotary_dim or rope_interleaved without "
                        "rope_theta"));
}

TEST_F(WeightsDirTest, MissingWeightsDirFailsStartNamingIt) {
  ServerOptions options = DefaultOptions();
  options.weights_dir = (root_ / "does-not-exist").string();
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr(options.weights_dir));
}

}  // namespace
}  // namespace attnserve
