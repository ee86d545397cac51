// The hot path of ringtrain's shared-memory all-reduce, in C++ (ringtrain/comm/shm_native.py builds it).
//
// It runs the same protocol as the Python path of ringtrain/comm/shm.py over the same workspace
// (shm_group.py's layout, shm_board.py's flag lines), so the two interoperate call by call: the barrier
// count lives in this rank's flag line, the buffer turns here (ShmGroup reads and writes them through
// ``small_turn`` / ``staging_turn``). What moves here is what
// cost time in Python: the dispatch of several torch ops per call, the barrier (a store and a poll of a
// peer's cache line, then a futex sleep that the peer's arrival wakes), and the reductions, which sum all
// ranks in one pass per block with vectorised loops. Staged calls, and direct ones from 8 KB, pick per
// message size plain or streaming (non-temporal) stores into the shared buffers, by which was faster
// lately (``choose_stores``):
// which wins depends on where the host placed the machine's cores, and that changes while a job runs. The GIL is released for large messages and for any
// wait that outlasts the poll (releasing and taking it back costs a few hundred nanoseconds: a third of a
// 4 KB all-reduce).
//
// Guarantees kept: every element is summed in rank order (x_0 + x_1 + ... + x_{n-1}) either by every
// rank from the same inputs (small messages) or once, by the shard's owner (large ones), so all ranks
// end with the same bits. Failures are detected as in shm_board.py (a peer's /proc/<pid>/stat, the
// timeout, the abort line) and reported to Python, which raises the same CollectiveError.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <climits>
#include <fstream>
#include <map>
#include <optional>
#include <linux/futex.h>
#include <string>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int LINE = 8;  // int64 words per 64-byte flag line (shm_board.LINE)
constexpr int PID = 1, DESC = 2;
constexpr int SLEEPERS = 1;  // word of the abort line: how many ranks sleep in a futex wait right now
constexpr int STORES = 2;    // word of the abort line: bit c set: local rank 0 found streaming stores faster for size class c
constexpr int64_t DIED = 1, TIMEOUT = 2, MISMATCH = 3, ABORTED = 4;  // ABORTED: another rank posted the abort line
constexpr int64_t STEP_MAX = (int64_t(1) << 24) - 1;
constexpr double LIVENESS_EVERY_S = 0.02;
constexpr int64_t BLOCK = 512;  // elements summed per block: the partial sums stay in L1
constexpr int MAX_RANKS = 64;   // local ranks a workspace serves (the algorithms keep per-rank arrays of this size)
constexpr int64_t MAX_ELEMENT = 8;  // bytes of the widest dtype reduced here

double now_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void cpu_relax() {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

// A futex on the low 32 bits of a rank's barrier count (x86 is little-endian): a waiter sleeps until the
// count changes, an arriving rank wakes whoever sleeps on its count. Not FUTEX_PRIVATE: the words live in
// a MAP_SHARED segment and the kernel keys them by page, so waits and wakes meet across processes.
inline uint32_t* futex_word(volatile int64_t* count) { return reinterpret_cast<uint32_t*>(const_cast<int64_t*>(count)); }

void futex_wait(volatile int64_t* count, int64_t seen, double timeout_s) {
    timespec limit{time_t(timeout_s), long((timeout_s - double(time_t(timeout_s))) * 1e9)};
    syscall(SYS_futex, futex_word(count), FUTEX_WAIT, uint32_t(seen), &limit, nullptr, 0);
}

void futex_wake(volatile int64_t* count) { syscall(SYS_futex, futex_word(count), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// --- element types: load as the accumulator type, store back rounded -----------------------------
struct BF16 {
    uint16_t bits;
};
inline float to_acc(BF16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline BF16 from_acc(float f, BF16*) {  // round to nearest even, NaN stays NaN (as c10::BFloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return BF16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}

struct F16 {
    uint16_t bits;
};
#if defined(__F16C__)
inline float to_acc(F16 x) { return _cvtsh_ss(x.bits); }
inline F16 from_acc(float f, F16*) { return F16{uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))}; }
#endif

inline float to_acc(float x) { return x; }
inline float from_acc(float f, float*) { return f; }
inline double to_acc(double x) { return x; }
inline double from_acc(double f, double*) { return f; }
// Integers wrap around like torch's: added as unsigned (signed overflow is undefined in C++).
inline uint32_t to_acc(int32_t x) { return uint32_t(x); }
inline int32_t from_acc(uint32_t v, int32_t*) { return int32_t(v); }
inline uint64_t to_acc(int64_t x) { return uint64_t(x); }
inline int64_t from_acc(uint64_t v, int64_t*) { return int64_t(v); }

template <typename T>
using Acc = decltype(to_acc(T{}));

// A copy whose stores bypass the caches (non-temporal): the lines go to memory and every other cache's copy
// is dropped without the read-for-ownership that a plain store of a line a peer holds waits for (across
// dies, ~2.6 GB/s). The caller fences (``stream_fence``) before it publishes the data: streaming stores are
// not ordered with later stores (the barrier count) otherwise.
inline void stream_copy(void* to, const void* from, size_t n) {
    char* d = static_cast<char*>(to);
    const char* s = static_cast<const char*>(from);
#if defined(__AVX512F__) || defined(__AVX2__)
    size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
    if (head > n) head = n;
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
#if defined(__AVX512F__)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#else
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
#endif
    }
#endif
    std::memcpy(d, s, n);
}
inline void stream_fence() {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

// out[i] = round(x_0[i] + x_1[i] + ... + x_{n-1}[i]), in rank order; ``own`` (if not null) replaces
// src[own_rank] and is divided by ``divide_by`` (rounded to T) first, as the copies of other ranks were.
// ``out`` may alias any source: each block is summed into a local buffer before it is stored.
template <typename T>
void sum_ranks(T* out, T* out2, T* const* src, int n, int64_t count, const T* own, int own_rank, int divide_by,
               bool stream = false) {
    using A = Acc<T>;
    alignas(64) A acc[BLOCK];
    for (int64_t lo = 0; lo < count; lo += BLOCK) {
        const int64_t m = std::min<int64_t>(BLOCK, count - lo);
        for (int j = 0; j < n; ++j) {
            const T* x = (own != nullptr && j == own_rank) ? own + lo : src[j] + lo;
            if (own != nullptr && j == own_rank && divide_by > 1) {
                if (j == 0) {
                    for (int64_t i = 0; i < m; ++i) acc[i] = to_acc(from_acc(to_acc(x[i]) / A(divide_by), (T*)nullptr));
                } else {
                    for (int64_t i = 0; i < m; ++i) acc[i] += to_acc(from_acc(to_acc(x[i]) / A(divide_by), (T*)nullptr));
                }
            } else if (j == 0) {
                for (int64_t i = 0; i < m; ++i) acc[i] = to_acc(x[i]);
            } else {
                for (int64_t i = 0; i < m; ++i) acc[i] += to_acc(x[i]);
            }
        }
        T* o = out + lo;
        for (int64_t i = 0; i < m; ++i) o[i] = from_acc(acc[i], (T*)nullptr);
        if (out2 != nullptr) {
            if (stream)
                stream_copy(out2 + lo, o, m * sizeof(T));
            else
                std::memcpy(out2 + lo, o, m * sizeof(T));
        }
    }
}

// to[i] = from[i] / divide_by (rounded to T), or a plain copy.
template <typename T>
void copy_in(T* to, const T* from, int64_t count, int divide_by, bool stream = false) {
    if (divide_by <= 1) {
        if (stream)
            stream_copy(to, from, count * sizeof(T));
        else
            std::memcpy(to, from, count * sizeof(T));
        return;
    }
    using A = Acc<T>;
    for (int64_t i = 0; i < count; ++i) to[i] = from_acc(to_acc(from[i]) / A(divide_by), (T*)nullptr);
}

struct Failure {
    int64_t reason = 0, peer = 0, step = 0, steps = 0, count = 0;
};

class Workspace {
   public:
    Workspace(int64_t base, int64_t header_bytes, int64_t region_bytes, int64_t small_bytes, int64_t piece_bytes,
              int local_rank, int local_size, bool spin, bool check_liveness)
        : base_(reinterpret_cast<char*>(base)),
          flags_(reinterpret_cast<volatile int64_t*>(base)),
          header_bytes_(header_bytes),
          region_bytes_(region_bytes),
          small_bytes_(small_bytes),
          piece_bytes_(piece_bytes),
          me_(local_rank),
          n_(local_size),
          check_liveness_(check_liveness),
          direct_bytes_(small_bytes),
          pipe_piece_bytes_(piece_bytes),
          small_turn_(0),
          staging_turn_(0),
          spin_s_(spin ? OWN_CORE_SPIN_S : SHARED_CORE_SPIN_S) {
        // Every buffer the algorithms write lies inside the mapped workspace (shm_group.py's layout): checked
        // once here, so that the calls need only O(1) checks of what they are given (``check_call``).
        TORCH_CHECK(base != 0, "shm_native: Workspace needs the address of a mapped workspace, got 0");
        TORCH_CHECK(local_size >= 1 && local_size <= MAX_RANKS, "shm_native: local_size must be in [1, ", MAX_RANKS,
                    "], got ", local_size);
        TORCH_CHECK(local_rank >= 0 && local_rank < local_size, "shm_native: local_rank must be in [0, ", local_size,
                    "), got ", local_rank);
        TORCH_CHECK(header_bytes >= int64_t(local_size + 1) * LINE * int64_t(sizeof(int64_t)),
                    "shm_native: header_bytes ", header_bytes, " cannot hold ", local_size + 1, " flag lines");
        TORCH_CHECK(small_bytes >= 0, "shm_native: small_bytes must be >= 0, got ", small_bytes);
        // A staged piece carries at least one element of every rank's shard: n of the widest dtype.
        TORCH_CHECK(piece_bytes >= local_size * MAX_ELEMENT, "shm_native: piece_bytes must be >= ",
                    local_size * MAX_ELEMENT, " (one 8-byte element per local rank), got ", piece_bytes);
        TORCH_CHECK(region_bytes >= 2 * small_bytes + 2 * piece_bytes, "shm_native: region_bytes ", region_bytes,
                    " cannot hold two small buffers of ", small_bytes, " and two staging buffers of ", piece_bytes);
        for (auto& code : codes_) code[0] = code[1] = -1;
        for (int r = 0; r < n_; ++r) pids_.push_back(int64_t(flags_[r * LINE + PID]));
    }

    // Tunables (bytes): messages up to ``direct_bytes`` are summed by every rank; larger ones are
    // reduce-scattered and all-gathered in pieces of ``piece_bytes`` per rank (at most the staging buffer).
    int64_t direct_bytes_, pipe_piece_bytes_;
    // How a call writes the shared buffers that its peers read (staged calls; direct ones from
    // DIRECT_CHOICE_BYTES, below which the two kinds measured the same): PLAIN stores, STREAM (non-temporal:
    // ``stream_copy``) or ADAPT: per message size (a power of two), the one whose recent calls were faster
    // (``choose_stores``). Why both: when the machine's two cores sit on different dies (a VM's vCPUs placed
    // apart by the host, which moves them every few seconds to minutes) a plain store to a line a peer
    // holds waits for the other die (~2.6 GB/s, a 64 MB call 33 ms instead of 7); streaming stores send the
    // lines to memory without that wait (7.7 ms), but on one die they cost 1.2-1.8x (the peer then reads
    // them from memory instead of the shared cache).
    static constexpr int PLAIN = 0, STREAM = 1, ADAPT = 2;
    int stream_mode_ = ADAPT;
    // Bit j: local rank j runs on this rank's core (both pinned to it; set by shm_group.py from the ranks'
    // affinity masks, 0 where unknown). With STREAM, a staged call writes the parts that only such a rank
    // reads with plain stores: it reads them from the core's own caches (streaming stores would send them to
    // memory first, which made STREAM 27 ms against plain's 21 at 4 ranks on 2 cores, 64 MB), while the
    // parts the other core's ranks read still skip the wait for the other die.
    int64_t near_mask_ = 0;
    // Barriers wait for the ranks on this rank's core first, asleep at once (a futex wait, no polling: polling
    // for one only keeps it off the core it needs), then for the others with the usual poll. Measured at 4
    // ranks on 2 cores, alternated in one run: 4 KB 30.7 -> 19.4 us, 64 KB 76.9 -> 46.4, 1 MB 341 -> 296.
    bool near_first_ = true;
    // Which of the two small / staging buffers the last call used (shared with the Python path).
    int64_t small_turn_, staging_turn_;
    // How long a wait polls the peer's count before it sleeps in the kernel (``wait_slow``).
    double spin_s_;
    // Time per phase of the calls (seconds, summed), taken while ``profile_`` is on; the counts always.
    struct Profile {
        double copy_in = 0, reduce = 0, gather = 0, wait = 0;
        int64_t calls = 0, barriers = 0, sleeps = 0, wakes = 0, streamed = 0;
    };
    bool profile_ = false;
    Profile prof_;

    std::map<std::string, double> profile_stats() const {
        return {{"calls", double(prof_.calls)},     {"barriers", double(prof_.barriers)}, {"sleeps", double(prof_.sleeps)},
                {"wakes", double(prof_.wakes)},     {"copy_in_s", prof_.copy_in},         {"reduce_s", prof_.reduce},
                {"gather_s", prof_.gather},         {"wait_s", prof_.wait},           {"streamed", double(prof_.streamed)}};
    }
    void reset_profile() { prof_ = Profile{}; }

    // The code of an all_reduce of ``dtype`` (shm_board.encode_call): sum, avg.
    void set_code(torch::ScalarType dtype, int64_t sum_code, int64_t avg_code) {
        TORCH_CHECK(int(dtype) >= 0 && int(dtype) < 64, "shm_native: dtype ", dtype, " out of the code table");
        codes_[int(dtype)][0] = sum_code;
        codes_[int(dtype)][1] = avg_code;
    }

    // Whether all_reduce takes ``t`` as it is: a dense contiguous non-empty CPU tensor of a dtype it
    // reduces (``dtypes()``), floating-point to average.
    bool takes(const torch::Tensor& t, bool average) const {
        if (!t.device().is_cpu() || t.layout() != torch::kStrided || !t.is_contiguous() || t.numel() == 0) return false;
        if (int(t.scalar_type()) >= 64 || codes_[int(t.scalar_type())][0] < 0) return false;
        return !average || t.is_floating_point();
    }

    // comm.all_reduce's hot path, one call from Python: ``t`` summed (averaged) in place over the host's ranks
    // if this path takes it as it is; ``timeout_s`` <= 0: the group's (``timeout_s_default``). Returns DONE,
    // FAILED (``failure()`` says what happened) or NOT_TAKEN: nothing was done, and the general path must
    // handle ``t`` (a dtype or layout this path does not take, or a tensor large enough to be reduced in
    // place if it lives in a shared arena, which Python looks up).
    int run(const torch::Tensor& t, bool average, double timeout_s) {
        if (!takes(t, average) || (arenas_ > 0 && int64_t(t.nbytes()) >= in_place_bytes_)) return NOT_TAKEN;
        FlightRecord* record = flight_begin(t, average);
        const bool failed = all_reduce(t, average, n_, timeout_s > 0 ? timeout_s : timeout_s_default_, 0, 0, 0);
        if (record != nullptr && !failed) __atomic_store_n(&record->end_ns, realtime_ns(), __ATOMIC_RELEASE);
        return failed ? FAILED : DONE;
    }

    // The flight recorder's record of ``run``'s calls (comm/flight.py merges them with the calls Python records,
    // by start time): kept here, as a Python entry cost 0.5 us a call, a fifth of a 4 KB all-reduce. The last
    // ``flight_capacity`` calls (0: none); a call that failed or is still running has end_ns 0.
    struct FlightRecord {
        int64_t nbytes = 0, start_ns = 0, end_ns = 0;
        int64_t caller = -1, step = 0;  // the caller region's code (flight.py's table) and step; -1: none
        torch::ScalarType dtype = torch::kFloat;
        bool average = false, has_step = false;
    };
    // The region open now (flight.region): set by Python as it enters and leaves one.
    void set_region(int64_t caller, std::optional<int64_t> step) {
        region_caller_ = caller;
        region_has_step_ = step.has_value();
        region_step_ = step.value_or(0);
    }
    int64_t flight_capacity() const { return flight_.empty() ? 0 : int64_t(flight_.size()) - 1; }
    void set_flight_capacity(int64_t capacity) {
        TORCH_CHECK(capacity >= 0, "shm_native: flight_capacity must be >= 0, got ", capacity);
        // One slot more than the records kept: the oldest slot of a full ring may be in rewrite (below).
        flight_.assign(capacity > 0 ? size_t(capacity) + 1 : 0, FlightRecord{});
        flight_first_ = flight_total_;  // records made under another capacity are not kept
    }
    // (calls recorded since the workspace started, [(nbytes, dtype, average, start_ns, end_ns, caller, step), ...]
    // of the last ones kept, oldest first). Read by the watchdog thread too, while a call runs without the GIL.
    using Row = std::tuple<int64_t, torch::ScalarType, bool, int64_t, int64_t, int64_t, std::optional<int64_t>>;
    std::tuple<int64_t, std::vector<Row>> flight_records() const {
        const int64_t total = __atomic_load_n(&flight_total_, __ATOMIC_ACQUIRE);
        std::vector<Row> out;
        const int64_t size = int64_t(flight_.size());
        if (size == 0) return {total, out};
        // Not the oldest slot of a full ring: the next call may be writing it over now.
        for (int64_t i = std::max(flight_first_, total - size + 1); i < total; ++i) {
            const FlightRecord& r = flight_[size_t(i % size)];
            out.emplace_back(r.nbytes, r.dtype, r.average, r.start_ns, __atomic_load_n(&r.end_ns, __ATOMIC_ACQUIRE),
                             r.caller, r.has_step ? std::optional<int64_t>(r.step) : std::nullopt);
        }
        return {total, out};
    }
    static constexpr int DONE = 0, FAILED = 1, NOT_TAKEN = 2;
    double timeout_s_default_ = 60.0;
    // Live shared arenas of the group (``shared_empty``), and the size from which a tensor in one is reduced
    // in place: ``run`` leaves such tensors to Python's lookup.
    int64_t arenas_ = 0, in_place_bytes_ = INT64_MAX;

    // All-reduce ``flat`` (which ``takes``) in place. ``arena`` > 0: the tensor lives in a shared arena (every
    // local rank's copy at arena + rank * stride + offset) and is reduced there without staging. Returns
    // true on failure; ``failure()`` then says what happened.
    bool all_reduce(const torch::Tensor& flat, bool average, int64_t divide_by, double timeout_s, int64_t arena,
                    int64_t stride, int64_t offset) {
        check_call(flat, divide_by, arena, stride, offset);
        const int64_t code = codes_[int(flat.scalar_type())][average ? 1 : 0];
        TORCH_CHECK(code >= 0, "shm_native: unsupported dtype ", flat.scalar_type());
        count_ = flags_[me_ * LINE];  // this rank's barrier count: its own flag line
        timeout_s_ = timeout_s;
        failure_ = Failure{};
        const int64_t numel = flat.numel();
        const int64_t nbytes = numel * flat.element_size();
        void* data = flat.data_ptr();
        const int div = average ? int(divide_by) : 1;
        const int64_t desc[3] = {numel, code, arena > 0 ? offset : -1};
        ++prof_.calls;
        if (profile_) mark_ = now_s();
        bool ok = true;
        {
            GilGuard guard(this);
            if (nbytes > RELEASE_GIL_BYTES) release_gil();
            switch (flat.scalar_type()) {
                case torch::kFloat: ok = dispatch<float>(data, numel, nbytes, div, desc, arena, stride, offset); break;
                case torch::kDouble: ok = dispatch<double>(data, numel, nbytes, div, desc, arena, stride, offset); break;
                case torch::kBFloat16: ok = dispatch<BF16>(data, numel, nbytes, div, desc, arena, stride, offset); break;
#if defined(__F16C__)
                case torch::kHalf: ok = dispatch<F16>(data, numel, nbytes, div, desc, arena, stride, offset); break;
#endif
                case torch::kInt: ok = dispatch<int32_t>(data, numel, nbytes, div, desc, arena, stride, offset); break;
                case torch::kLong: ok = dispatch<int64_t>(data, numel, nbytes, div, desc, arena, stride, offset); break;
                default: TORCH_CHECK(false, "shm_native: unsupported dtype ", flat.scalar_type());
            }
        }
        return !ok;
    }

    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> failure() const {
        return {failure_.reason, failure_.peer, failure_.step, failure_.steps, failure_.count};
    }

   private:
    // What a call may touch, before it touches anything or meets a peer (O(1)): the tensor's bytes are the
    // ``numel * element_size`` from its data pointer, the turns pick one of two buffers, and an arena copy
    // lies inside its rank's region. A refused call is a RuntimeError and changes nothing.
    void check_call(const torch::Tensor& flat, int64_t divide_by, int64_t arena, int64_t stride, int64_t offset) const {
        TORCH_CHECK(flat.device().is_cpu() && flat.layout() == torch::kStrided && flat.is_contiguous(),
                    "shm_native: all_reduce needs a contiguous dense CPU tensor");
        TORCH_CHECK(int(flat.scalar_type()) >= 0 && int(flat.scalar_type()) < 64, "shm_native: unsupported dtype ",
                    flat.scalar_type());
        TORCH_CHECK(divide_by >= 1 && divide_by <= INT_MAX, "shm_native: divide_by must be in [1, ", INT_MAX, "], got ",
                    divide_by);
        TORCH_CHECK((small_turn_ | staging_turn_) >= 0 && (small_turn_ | staging_turn_) <= 1,
                    "shm_native: small_turn and staging_turn must be 0 or 1, got ", small_turn_, " and ", staging_turn_);
        if (arena > 0) {
            const int64_t nbytes = flat.numel() * int64_t(flat.element_size());
            TORCH_CHECK(stride > 0 && offset >= 0 && offset <= stride && nbytes <= stride - offset, "shm_native: ",
                        nbytes, " bytes at offset ", offset, " do not fit a rank's arena region of ", stride, " bytes");
        }
    }

    std::vector<FlightRecord> flight_;
    int64_t flight_total_ = 0, flight_first_ = 0;
    int64_t region_caller_ = -1, region_step_ = 0;
    bool region_has_step_ = false;

    static int64_t realtime_ns() {  // the clock of Python's time.time_ns(), which the other records use
        timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
    }
    FlightRecord* flight_begin(const torch::Tensor& t, bool average) {
        if (flight_.empty()) return nullptr;
        FlightRecord* record = &flight_[size_t(flight_total_ % int64_t(flight_.size()))];
        record->nbytes = int64_t(t.nbytes());
        record->dtype = t.scalar_type();
        record->average = average;
        record->caller = region_caller_;
        record->step = region_step_;
        record->has_step = region_has_step_;
        record->start_ns = realtime_ns();
        __atomic_store_n(&record->end_ns, int64_t(0), __ATOMIC_RELAXED);
        __atomic_store_n(&flight_total_, flight_total_ + 1, __ATOMIC_RELEASE);  // the record, then its count
        return record;
    }

    static constexpr int64_t RELEASE_GIL_BYTES = 64 << 10;
    // Polling before a sleep: 2 ms when every rank has a core of its own (a peer in step arrives within
    // microseconds, and a futex wake costs several); a few microseconds when ranks share cores, where the
    // peer may be waiting for this very core.
    static constexpr double OWN_CORE_SPIN_S = 0.002, SHARED_CORE_SPIN_S = 5e-6;
    int64_t codes_[64][2];  // by ScalarType: the call codes, -1 where the dtype is not reduced here
    PyThreadState* released_ = nullptr;  // set while this call runs without the GIL

    void release_gil() {
        if (released_ == nullptr) released_ = PyEval_SaveThread();
    }
    struct GilGuard {  // takes the GIL back however the call ends
        Workspace* self;
        explicit GilGuard(Workspace* w) : self(w) {}
        ~GilGuard() {
            if (self->released_ != nullptr) {
                PyEval_RestoreThread(self->released_);
                self->released_ = nullptr;
            }
        }
    };

    // ADAPT: all ranks use the kind that local rank 0 found faster for the size class (log2 of the bytes):
    // one bit per class in the abort line's STORES word, which only rank 0 writes. A rank's call lasts as
    // long as the slowest rank's part, so rank 0's own call time measures the kind that all used. Rank 0
    // keeps per class the recent time of each kind (exponential average of the kind in use; 0: not tried)
    // and its count of calls; every rank counts the same calls (they make the same calls in the same
    // order), so all try the other kind together: calls 0 and 1 of a class (plain, then streaming), then
    // every EXPLORE_EVERY-th. A change of the machine's state is seen at once when it slows the kind in
    // use, within EXPLORE_EVERY calls when it speeds up the other. A rank that read an older choice (it
    // began the call before rank 0 ended the last one) computes the same bits: only how the bytes reach
    // the staging buffer differs.
    static constexpr int64_t EXPLORE_EVERY = 16;
    static constexpr double STREAM_MARGIN = 0.8;
    static constexpr int64_t DIRECT_CHOICE_BYTES = 8 << 10;
    double store_cost_[64][2] = {};
    int64_t store_calls_[64] = {};

    int choose_stores(int size_class) {
        if (stream_mode_ != ADAPT) return stream_mode_ == STREAM ? STREAM : PLAIN;
        const int64_t call = store_calls_[size_class]++;
        if (call < 2) return int(call);
        const int64_t bits = __atomic_load_n(const_cast<int64_t*>(&flags_[n_ * LINE + STORES]), __ATOMIC_RELAXED);
        const int best = int((bits >> size_class) & 1);
        return call % EXPLORE_EVERY == EXPLORE_EVERY - 1 ? 1 - best : best;
    }
    void learn_stores(int size_class, int kind, double seconds) {
        if (stream_mode_ != ADAPT || me_ != 0) return;
        volatile int64_t* word = &flags_[n_ * LINE + STORES];
        const int64_t bits = *word;
        double* cost = store_cost_[size_class];
        // The kind in use: averaged; the other (a try): its latest time, as the state may have changed since.
        cost[kind] = (cost[kind] == 0 || kind != int((bits >> size_class) & 1)) ? seconds : cost[kind] + 0.5 * (seconds - cost[kind]);
        if (cost[PLAIN] == 0 || cost[STREAM] == 0) return;
        // Streaming only when clearly faster: a try of plain stores after streaming ones is slower than plain
        // stores in use (the staging lines come from memory for the first call), which must not keep them out.
        const int64_t bit = int64_t(1) << size_class;
        const int64_t want = cost[STREAM] < STREAM_MARGIN * cost[PLAIN] ? (bits | bit) : (bits & ~bit);
        if (want != bits) __atomic_store_n(const_cast<int64_t*>(word), want, __ATOMIC_RELAXED);
    }

    char* base_;
    volatile int64_t* flags_;
    int64_t header_bytes_, region_bytes_, small_bytes_, piece_bytes_;
    int me_, n_;
    bool check_liveness_;
    double mark_ = 0;  // when the current phase began (profiling)

    void lap(double& phase) {  // the time since the last mark goes to ``phase``
        if (profile_) {
            const double t = now_s();
            phase += t - mark_;
            mark_ = t;
        }
    }
    std::vector<int64_t> pids_;
    int64_t count_ = 0;
    double timeout_s_ = 60.0;
    Failure failure_;

    char* small_buffer(int rank, int64_t turn) const {
        return base_ + header_bytes_ + rank * region_bytes_ + turn * small_bytes_;
    }
    char* staging_buffer(int rank, int64_t turn) const {
        return base_ + header_bytes_ + rank * region_bytes_ + 2 * small_bytes_ + turn * piece_bytes_;
    }

    template <typename T>
    bool dispatch(void* data, int64_t numel, int64_t nbytes, int div, const int64_t* desc, int64_t arena,
                  int64_t stride, int64_t offset) {
        T* flat = static_cast<T*>(data);
        if (nbytes <= direct_bytes_ && nbytes <= small_bytes_) return direct<T>(flat, numel, div, desc);
        if (arena > 0) return in_place<T>(flat, numel, div, desc, reinterpret_cast<char*>(arena), stride, offset);
        return pipelined<T>(flat, numel, nbytes, div, desc);
    }

    // --- barriers (shm_board.FlagBoard.arrive / wait_all / check_same_call) ---------------------------
    bool arrive(const int64_t* desc) {
        if (flags_[n_ * LINE] != 0) return fail(ABORTED, 0, 0, 0);
        const int64_t count = ++count_;
        if (desc != nullptr) {
            const int base = me_ * LINE + DESC + 3 * int(count & 1);
            for (int i = 0; i < 3; ++i) flags_[base + i] = desc[i];
        }
        // Last: a peer that sees the count sees the data written before it. Sequentially consistent (an
        // xchg, a full barrier), so that of this store and a sleeping peer's mark (``wait_slow``) at least
        // one sees the other: either the peer sees the count and does not sleep, or it is woken here.
        __atomic_store_n(const_cast<int64_t*>(&flags_[me_ * LINE]), count, __ATOMIC_SEQ_CST);
        ++prof_.barriers;
        if (__atomic_load_n(const_cast<int64_t*>(&flags_[n_ * LINE + SLEEPERS]), __ATOMIC_SEQ_CST) > 0) {
            futex_wake(&flags_[me_ * LINE]);
            ++prof_.wakes;
        }
        return true;
    }

    int64_t peer_count(int peer) const {
        return __atomic_load_n(const_cast<int64_t*>(&flags_[peer * LINE]), __ATOMIC_ACQUIRE);
    }

    bool wait_all(int64_t step, int64_t steps) {
        if (near_first_ && near_mask_ != 0) {
            // Ranks on this core first, asleep at once: polling for one only keeps it off the core.
            for (int peer = 0; peer < n_; ++peer) {
                if (peer != me_ && ((near_mask_ >> peer) & 1) && peer_count(peer) < count_ &&
                    !wait_slow(peer, step, steps, 0.0))
                    return false;
            }
        }
        for (int peer = 0; peer < n_; ++peer) {
            if (peer != me_ && peer_count(peer) < count_ && !wait_slow(peer, step, steps, spin_s_)) return false;
        }
        return true;
    }

    bool check_same_call(const int64_t* desc) {
        const int slot = DESC + 3 * int(count_ & 1);
        for (int peer = 0; peer < n_; ++peer) {
            if (peer == me_) continue;
            const int base = peer * LINE + slot;
            if (flags_[base] != desc[0] || flags_[base + 1] != desc[1] || flags_[base + 2] != desc[2]) {
                // Python's check_same_call names both calls and posts the abort.
                failure_ = Failure{MISMATCH, peer, 1, 0, count_};
                return false;
            }
        }
        return true;
    }

    bool wait_slow(int peer, int64_t step, int64_t steps, double spin_s) {
        const int64_t count = count_;
        // Poll first (the clock read every 64 looks): a peer on another core, in step, arrives within
        // microseconds.
        const double spin_until = now_s() + spin_s;
        do {
            for (int i = 0; i < 64; ++i) {
                if (peer_count(peer) >= count) return true;
                cpu_relax();
            }
        } while (now_s() < spin_until);
        // Then sleep in the kernel until the peer's count changes (its ``arrive`` wakes us), which hands this
        // core to a peer that shares it at once. Yielding did not: under EEVDF sched_yield keeps the core
        // for a waiter whose peer has had its share, and the waiter polled for the rest of its slice
        // (0.75 ms per barrier with 4 ranks on 2 cores). The futex sleeps at most until the next liveness
        // check (every 20 ms), so a peer that dies or stops is still found.
        release_gil();
        volatile int64_t* theirs = &flags_[peer * LINE];
        volatile int64_t* sleepers = &flags_[n_ * LINE + SLEEPERS];
        const double start = now_s();
        const double deadline = start + timeout_s_;
        double next_check = start + LIVENESS_EVERY_S;
        while (true) {
            if (flags_[n_ * LINE] != 0) return fail(ABORTED, 0, step, steps);
            const double now = now_s();
            if (now >= next_check) {
                next_check = now + LIVENESS_EVERY_S;
                const char state = peer_state(peer);
                if (state == 'D') {
                    if (peer_count(peer) >= count) return true;  // it arrived, then exited
                    post_abort(peer, DIED, step);
                    return fail(DIED, peer, step, steps);
                }
                if (now >= deadline) {
                    post_abort(peer, TIMEOUT, step);
                    return fail(TIMEOUT, peer, step, steps);
                }
            }
            __atomic_fetch_add(const_cast<int64_t*>(sleepers), 1, __ATOMIC_SEQ_CST);  // a full barrier too
            const int64_t seen = peer_count(peer);
            if (seen < count) {
                futex_wait(theirs, seen, std::max(1e-5, std::min(next_check, deadline) - now));
                ++prof_.sleeps;
            }
            __atomic_fetch_sub(const_cast<int64_t*>(sleepers), 1, __ATOMIC_SEQ_CST);
            if (seen >= count || peer_count(peer) >= count) return true;
        }
    }

    // 'D' dead (gone or a zombie), 'R' anything else or unknown (shm_board.FlagBoard._state).
    char peer_state(int peer) const {
        if (!check_liveness_) return 'R';
        std::ifstream stat("/proc/" + std::to_string(pids_[peer]) + "/stat");
        if (!stat) return 'D';
        std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
        const auto close = text.rfind(')');
        if (close == std::string::npos || close + 2 >= text.size()) return 'R';
        const char state = text[close + 2];
        return (state == 'Z' || state == 'X' || state == 'x') ? 'D' : 'R';
    }

    void post_abort(int culprit, int64_t reason, int64_t step) {
        volatile int64_t* line = &flags_[n_ * LINE];
        if (*line != 0) return;
        *line = reason << 56 | int64_t(culprit) << 40 | int64_t(me_) << 24 | std::min(step, STEP_MAX);
        for (int r = 0; r < n_; ++r) futex_wake(&flags_[r * LINE]);  // sleepers wake and see the report
    }

    bool fail(int64_t reason, int peer, int64_t step, int64_t steps) {
        failure_ = Failure{reason, peer, step, steps, count_};
        return false;
    }

    // --- the algorithms (shm.py's _direct, _pipelined, _in_place) --------------------------------------
    template <typename T>
    bool direct(T* flat, int64_t numel, int div, const int64_t* desc) {
        TORCH_CHECK(numel * int64_t(sizeof(T)) <= small_bytes_, "shm_native: ", numel * int64_t(sizeof(T)),
                    " bytes do not fit the small buffer of ", small_bytes_);
        small_turn_ ^= 1;
        T* src[64];
        for (int j = 0; j < n_; ++j) src[j] = reinterpret_cast<T*>(small_buffer(j, small_turn_));
        const int64_t nbytes = numel * int64_t(sizeof(T));
        const int size_class = nbytes >= DIRECT_CHOICE_BYTES ? 63 - __builtin_clzll(uint64_t(nbytes)) : -1;
        const int stores = size_class >= 0 ? choose_stores(size_class) : PLAIN;
        prof_.streamed += stores == STREAM;
        // Timed whole: on two dies the stores into lines the peers read last call and the peers' reads of
        // them are where the time goes, and the wait holds the peers' part.
        const double started = size_class >= 0 ? now_s() : 0;
        copy_in<T>(src[me_], flat, numel, div, stores == STREAM);
        if (stores == STREAM) stream_fence();
        lap(prof_.copy_in);
        if (!arrive(desc) || !wait_all(1, 1) || !check_same_call(desc)) return false;
        lap(prof_.wait);
        // Every rank adds the same buffers in the same order: bit-identical results.
        sum_ranks<T>(flat, nullptr, src, n_, numel, nullptr, me_, 1);
        lap(prof_.reduce);
        if (size_class >= 0) learn_stores(size_class, stores, now_s() - started);
        return true;
    }

    template <typename T>
    bool pipelined(T* flat, int64_t numel, int64_t nbytes, int div, const int64_t* desc) {
        const int n = n_, me = me_;
        const int64_t align = std::max<int64_t>(1, 64 / int64_t(sizeof(T)));
        int64_t per_shard = (numel + n - 1) / n;
        per_shard = (per_shard + align - 1) / align * align;
        int64_t lo_of[64], hi_of[64];
        for (int r = 0; r < n; ++r) {
            lo_of[r] = std::min(numel, r * per_shard);
            hi_of[r] = std::min(numel, (r + 1) * per_shard);
        }
        const int64_t piece = std::min(piece_bytes_, pipe_piece_bytes_);
        const int64_t q = std::max<int64_t>(1, piece / int64_t(sizeof(T)) / n);  // elements of each shard per piece
        const int64_t pieces = std::max<int64_t>(1, (per_shard + q - 1) / q);
        // Piece k writes q elements of each of the n shards into a staging buffer: they must fit it.
        TORCH_CHECK(q * n * int64_t(sizeof(T)) <= piece_bytes_, "shm_native: pieces of ", q, " x ", n, " elements do not ",
                    "fit the staging buffer of ", piece_bytes_, " bytes");
        const int size_class = 63 - __builtin_clzll(uint64_t(nbytes));
        const int stores = choose_stores(size_class);
        const bool stream = stores == STREAM;
        prof_.streamed += stream;
        const int64_t first_turn = staging_turn_ ^ 1;
        staging_turn_ ^= pieces & 1;  // the next call starts on the buffer after this call's last piece
        auto part = [&](int64_t k, int j, int64_t& lo, int64_t& hi) {
            lo = std::min(hi_of[j], lo_of[j] + k * q);
            hi = std::min(hi_of[j], lo_of[j] + (k + 1) * q);
        };
        auto buffers = [&](int64_t k, T** out) {
            for (int j = 0; j < n; ++j) out[j] = reinterpret_cast<T*>(staging_buffer(j, first_turn ^ (k & 1)));
        };
        auto near = [&](int j) { return ((near_mask_ >> j) & 1) != 0; };
        bool all_near = true;
        for (int j = 0; j < n; ++j) all_near = all_near && (j == me || near(j));
        auto copy_piece_in = [&](int64_t k) {  // the parts of piece k that the other ranks reduce
            T* bufs[64];
            buffers(k, bufs);
            for (int j = 0; j < n; ++j) {
                int64_t lo, hi;
                part(k, j, lo, hi);
                if (j != me && hi > lo) copy_in<T>(bufs[me] + j * q, flat + lo, hi - lo, div, stream && !near(j));
            }
        };
        auto reduce_and_publish = [&](int64_t k) {
            T* bufs[64];
            T* src[64];
            buffers(k, bufs);
            int64_t lo, hi;
            part(k, me, lo, hi);
            if (hi <= lo) return;
            for (int j = 0; j < n; ++j) src[j] = bufs[j] + me * q;
            // Sum in rank order, this rank's own part straight from ``flat``; store into flat and the slot (which
            // every other rank reads: streamed with STREAM unless all of them share this rank's core).
            sum_ranks<T>(flat + lo, bufs[me] + me * q, src, n, hi - lo, flat + lo, me, div, stream && !all_near);
        };
        auto gather = [&](int64_t k) {
            T* bufs[64];
            buffers(k, bufs);
            for (int j = 0; j < n; ++j) {
                int64_t lo, hi;
                part(k, j, lo, hi);
                if (j != me && hi > lo) std::memcpy(flat + lo, bufs[j] + j * q, (hi - lo) * sizeof(T));
            }
        };
        copy_piece_in(0);
        if (stream) stream_fence();
        lap(prof_.copy_in);
        if (!arrive(desc) || !wait_all(1, pieces + 1) || !check_same_call(desc)) return false;
        lap(prof_.wait);
        // Timed from here, when all ranks are in the call: how far apart they entered it is not the stores' doing.
        const double started = now_s();
        for (int64_t k = 1; k <= pieces; ++k) {
            if (k >= 2) gather(k - 2);
            lap(prof_.gather);
            reduce_and_publish(k - 1);
            lap(prof_.reduce);
            if (k < pieces) copy_piece_in(k);
            lap(prof_.copy_in);
            if (stream) stream_fence();
            if (!arrive(nullptr) || !wait_all(k + 1, pieces + 1)) return false;
            lap(prof_.wait);
        }
        gather(pieces - 1);
        lap(prof_.gather);
        learn_stores(size_class, stores, now_s() - started);
        return true;
    }

    template <typename T>
    bool in_place(T* flat, int64_t numel, int div, const int64_t* desc, char* arena, int64_t stride, int64_t offset) {
        const int n = n_, me = me_;
        T* peers[64];
        for (int j = 0; j < n; ++j) peers[j] = reinterpret_cast<T*>(arena + j * stride + offset);
        const int64_t align = std::max<int64_t>(1, 64 / int64_t(sizeof(T)));
        int64_t per_shard = (numel + n - 1) / n;
        per_shard = (per_shard + align - 1) / align * align;
        if (div > 1) copy_in<T>(flat, flat, numel, div);
        lap(prof_.copy_in);
        if (!arrive(desc) || !wait_all(1, 3) || !check_same_call(desc)) return false;
        lap(prof_.wait);
        const int64_t lo = std::min(numel, me * per_shard), hi = std::min(numel, (me + 1) * per_shard);
        if (hi > lo) {
            T* src[64];
            for (int j = 0; j < n; ++j) src[j] = peers[j] + lo;
            sum_ranks<T>(flat + lo, nullptr, src, n, hi - lo, nullptr, me, 1);
        }
        lap(prof_.reduce);
        if (!arrive(nullptr) || !wait_all(2, 3)) return false;
        lap(prof_.wait);
        for (int j = 0; j < n; ++j) {
            const int64_t jlo = std::min(numel, j * per_shard), jhi = std::min(numel, (j + 1) * per_shard);
            if (j != me && jhi > jlo) std::memcpy(flat + jlo, peers[j] + jlo, (jhi - jlo) * sizeof(T));
        }
        lap(prof_.gather);
        // Peers may still be copying this rank's shard: nobody returns (and overwrites) before all are done.
        const bool ok = arrive(nullptr) && wait_all(3, 3);
        lap(prof_.wait);
        return ok;
    }
};

// ``Workspace.fast_run()``: ``run`` as a plain CPython function (METH_FASTCALL) bound to the workspace:
// pybind11's dispatch of ``run`` (argument matching, the tensor's caster) took 0.3 us a call, a sixth of a
// 4 KB all-reduce. ``fast(tensor, average, timeout_s)`` -> DONE / FAILED / NOT_TAKEN as ``run``; anything
// but an exact torch.Tensor is NOT_TAKEN (the general path checks it). Its ``self`` is a capsule that holds
// the workspace and a reference to its Python object, so the function keeps the workspace alive.
struct FastRun {
    Workspace* workspace;
    PyObject* owner;
};

PyObject* fast_run_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    auto* bound = static_cast<FastRun*>(PyCapsule_GetPointer(self, "ringtrain.FastRun"));
    if (bound == nullptr) return nullptr;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fast run takes (tensor, average, timeout_s)");
        return nullptr;
    }
    if (!THPVariable_CheckExact(args[0])) return PyLong_FromLong(Workspace::NOT_TAKEN);
    const double timeout_s = PyFloat_AsDouble(args[2]);
    if (timeout_s == -1.0 && PyErr_Occurred()) return nullptr;
    try {
        return PyLong_FromLong(bound->workspace->run(THPVariable_Unpack(args[0]), args[1] == Py_True, timeout_s));
    } catch (const std::exception& err) {
        PyErr_SetString(PyExc_RuntimeError, err.what());
        return nullptr;
    }
}

PyMethodDef fast_run_def = {"fast_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(fast_run_call)),
                            METH_FASTCALL, "Workspace.run without pybind11's dispatch"};

void fast_run_free(PyObject* capsule) {
    auto* bound = static_cast<FastRun*>(PyCapsule_GetPointer(capsule, "ringtrain.FastRun"));
    if (bound != nullptr) {
        Py_XDECREF(bound->owner);
        delete bound;
    }
}

pybind11::object fast_run(pybind11::object owner) {
    auto* bound = new FastRun{owner.cast<Workspace*>(), owner.ptr()};
    Py_INCREF(owner.ptr());
    PyObject* capsule = PyCapsule_New(bound, "ringtrain.FastRun", fast_run_free);
    if (capsule == nullptr) {
        Py_DECREF(owner.ptr());
        delete bound;
        throw pybind11::error_already_set();
    }
    PyObject* function = PyCFunction_New(&fast_run_def, capsule);
    Py_DECREF(capsule);  // the function holds it now
    if (function == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(function);
}

std::vector<std::string> dtypes() {
    std::vector<std::string> names{"float32", "float64", "bfloat16", "int32", "int64"};
#if defined(__F16C__)
    names.push_back("float16");
#endif
    return names;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ringtrain's shared-memory all-reduce hot path (see ringtrain/comm/shm_native.py)";
    m.def("dtypes", &dtypes, "the dtypes the native path reduces; others take the Python path");
    pybind11::class_<Workspace>(m, "Workspace")
        .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool, bool>())
        .def("all_reduce", &Workspace::all_reduce)
        .def("takes", &Workspace::takes)
        .def("run", &Workspace::run)
        .def("fast_run", &fast_run)
        .def_property("flight_capacity", &Workspace::flight_capacity, &Workspace::set_flight_capacity)
        .def("flight_records", &Workspace::flight_records)
        .def("set_region", &Workspace::set_region)
        .def_readwrite("timeout_s_default", &Workspace::timeout_s_default_)
        .def_readwrite("arenas", &Workspace::arenas_)
        .def_readwrite("in_place_bytes", &Workspace::in_place_bytes_)
        .def("set_code", &Workspace::set_code)
        .def("failure", &Workspace::failure)
        .def_readwrite("direct_bytes", &Workspace::direct_bytes_)
        .def_readwrite("piece_bytes", &Workspace::pipe_piece_bytes_)
        .def_readwrite("stream_mode", &Workspace::stream_mode_)
        .def_readwrite("near_mask", &Workspace::near_mask_)
        .def_readwrite("small_turn", &Workspace::small_turn_)
        .def_readwrite("staging_turn", &Workspace::staging_turn_)
        .def_readwrite("spin_s", &Workspace::spin_s_)
        .def_readwrite("near_first", &Workspace::near_first_)
        .def_readwrite("profile", &Workspace::profile_)
        .def("profile_stats", &Workspace::profile_stats)
        .def("reset_profile", &Workspace::reset_profile);
}
