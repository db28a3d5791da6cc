// ThreadSanitizer annotations for Debian's uninstrumented Abseil
// synchronization.
//
// Debian builds libabsl_synchronization.so without -fsanitize=thread, so the
// happens-before edges of absl::Mutex, CondVar, Notification, BlockingCounter
// and Barrier (atomics and futexes inside that library) are invisible to TSan,
// and every access guarded by an absl::Mutex would be reported as a race.
// Abseil's own TSan build annotates these with __tsan_mutex_* calls; this
// library puts the equivalent edges back from outside: preloaded
// (LD_PRELOAD, scripts/sanitize), it interposes the non-inline members of those
// classes, forwards each to Debian's definition (dlsym(RTLD_NEXT)) and tells
// TSan, with __tsan_release before a release and __tsan_acquire after an
// acquire, which operation publishes memory to which.
//
// A Condition runs with the mutex held but inside Debian's code: on the waiting
// thread, or on another thread inside its Unlock. So every Condition passed in
// is wrapped to acquire the mutex's edges before it runs and release them
// after, and a thread that starts waiting (Await, LockWhen) releases the
// mutex's edges first, so that whoever evaluates its Condition sees the
// Condition and what it reads. This file itself is compiled without TSan
// instrumentation: its wrapper Conditions are handed to other threads by
// Debian's code, which TSan cannot see.
//
// It models happens-before only: TSan still finds data races on memory that no
// absl lock orders, but it does not know which thread holds which mutex, so its
// lock-order (deadlock) detection does not cover absl::Mutex.
//
// Built only when ATTNSERVE_SANITIZE=thread; never linked into anything.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#define ATTNSERVE_STRINGIFY_INNER(x) #x
#define ATTNSERVE_STRINGIFY(x) ATTNSERVE_STRINGIFY_INNER(x)

namespace {

// Debian's definition of the member whose Itanium mangled name is
// "_ZN<qualifiers>4absl<inline namespace><suffix>" (qualifiers: "K" for a
// const member, else ""); aborts if it is missing.
void* RealMember(const char* qualifiers, const char* suffix) {
  const char* inline_namespace =
      ATTNSERVE_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = std::string("_ZN") + qualifiers + "4absl" +
                           std::to_string(std::strlen(inline_namespace)) +
                           inline_namespace + suffix;
  void* real = dlsym(RTLD_NEXT, name.c_str());
  if (real == nullptr) {
    std::fprintf(stderr, "absl_tsan_annotations: %s not found: %s\n",
                 name.c_str(), dlerror());
    std::abort();
  }
  return real;
}

template <typename Function>
Function Real(const char* suffix) {
  return reinterpret_cast<Function>(RealMember("", suffix));
}

template <typename Function>
Function RealConst(const char* suffix) {
  return reinterpret_cast<Function>(RealMember("K", suffix));
}

// The TSan runtime's annotation, looked up in the process rather than linked:
// the test programs' children (sh, openssl, rm for test certificates) inherit
// LD_PRELOAD, and this library must load in them, without the TSan runtime,
// as a no-op.
using Annotation = void (*)(void*);
Annotation TsanFunction(const char* name) {
  return reinterpret_cast<Annotation>(dlsym(RTLD_DEFAULT, name));
}

void Acquire(const void* address) {
  static const Annotation acquire = TsanFunction("__tsan_acquire");
  if (acquire != nullptr) acquire(const_cast<void*>(address));
}
void Release(const void* address) {
  static const Annotation release = TsanFunction("__tsan_release");
  if (release != nullptr) release(const_cast<void*>(address));
}

// A Condition that acquires its mutex's edges, then evaluates `inner`.
class AnnotatedCondition {
 public:
  AnnotatedCondition(const absl::Condition& inner, const absl::Mutex* mutex)
      : inner_(inner), mutex_(mutex), condition_(&Evaluate, this) {}

  const absl::Condition& condition() const { return condition_; }

 private:
  static bool Evaluate(AnnotatedCondition* self) {
    Acquire(self->mutex_);
    const bool result = self->inner_.Eval();
    Release(self->mutex_);
    return result;
  }

  const absl::Condition& inner_;
  const absl::Mutex* const mutex_;
  const absl::Condition condition_;
};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Mutex: acquiring operations acquire `this`, releasing ones release it.

void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  Acquire(this);
}

void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  Acquire(this);
}

bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  Release(this);
  real(this);
}

void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  Release(this);
  real(this);
}

void Mutex::LockWhen(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>(
      "5Mutex8LockWhenERKNS0_9ConditionE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  real(this, annotated.condition());
  Acquire(this);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>(
      "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  real(this, annotated.condition());
  Acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), timeout);
  Acquire(this);
  return result;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond,
                                      absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), timeout);
  Acquire(this);
  return result;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), deadline);
  Acquire(this);
  return result;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond,
                                       absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), deadline);
  Acquire(this);
  return result;
}

// Await releases the mutex while it waits and holds it again on return.

void Mutex::Await(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>(
      "5Mutex5AwaitERKNS0_9ConditionE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  real(this, annotated.condition());
  Acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), timeout);
  Acquire(this);
  return result;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated(cond, this);
  Release(this);
  const bool result = real(this, annotated.condition(), deadline);
  Acquire(this);
  return result;
}

// CondVar: waiting releases the mutex and holds it again on return.

void CondVar::Wait(Mutex* mu) {
  static auto real =
      Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  real(this, mu);
  Acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  const bool result = real(this, mu, timeout);
  Acquire(mu);
  return result;
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  const bool result = real(this, mu, deadline);
  Acquire(mu);
  return result;
}

// Notification: Notify releases the flag that the inline HasBeenNotified
// loads with acquire order (TSan sees that load), and the waits acquire it.

void Notification::Notify() {
  static auto real = Real<void (*)(Notification*)>("12Notification6NotifyEv");
  Release(&notified_yet_);
  real(this);
}

void Notification::WaitForNotification() const {
  static auto real = RealConst<void (*)(const Notification*)>(
      "12Notification19WaitForNotificationEv");
  real(this);
  Acquire(&notified_yet_);
}

bool Notification::WaitForNotificationWithTimeout(
    absl::Duration timeout) const {
  static auto real = RealConst<bool (*)(const Notification*, absl::Duration)>(
      "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  Acquire(&notified_yet_);
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static auto real = RealConst<bool (*)(const Notification*, absl::Time)>(
      "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  Acquire(&notified_yet_);
  return notified;
}

// BlockingCounter and Barrier: everything before a DecrementCount or Block
// happens before every return from Wait or Block.

bool BlockingCounter::DecrementCount() {
  static auto real =
      Real<bool (*)(BlockingCounter*)>("15BlockingCounter14DecrementCountEv");
  Release(this);
  return real(this);
}

void BlockingCounter::Wait() {
  static auto real =
      Real<void (*)(BlockingCounter*)>("15BlockingCounter4WaitEv");
  real(this);
  Acquire(this);
}

bool Barrier::Block() {
  static auto real = Real<bool (*)(Barrier*)>("7Barrier5BlockEv");
  Release(this);
  const bool last = real(this);
  Acquire(this);
  return last;
}

ABSL_NAMESPACE_END
}  // namespace absl
