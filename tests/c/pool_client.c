/* An engine in C, against the generated header: attach to a running pool,
 * compute block keys, save blocks from its own memory, find them in the
 * mirror, load them back into other blocks of its memory, check every
 * byte; and bad arguments answered with errors, never a crash. Then a
 * paged KV cache described piece by piece: saved from one memory order
 * (per-layer tensors, heads before tokens) and loaded into another
 * (blocks first, tokens before heads), element for element.
 *
 * usage: pool_client DP_SOCKET MIRROR_PATH CP_SOCKET BLOCK_BYTES
 * Prints "OK" and exits 0 when every check passed. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lake.h"

#define BLOCKS 8
#define TOKENS_PER_BLOCK 16

static int failures = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            char why[256];                                                 \
            lake_last_error(why, sizeof why);                              \
            fprintf(stderr, "FAILED line %d: ", __LINE__);                 \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, " (last error: %s)\n", why);                   \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

#define KV_LAYERS 2
#define KV_HEADS 2 /* of the model's 4: this rank's shard */
#define KV_DIM 16
#define KV_BLOCKS 6

/* Element (layer, plane, token, head, i) of engine block b, in each order. */
static size_t hnd_index(size_t l, size_t p, size_t b, size_t t, size_t h, size_t i) {
    /* per layer: [plane][block][head][token][dim] */
    return ((((l * 2 + p) * KV_BLOCKS + b) * KV_HEADS + h) * TOKENS_PER_BLOCK + t) * KV_DIM + i;
}
static size_t blocks_first_index(size_t l, size_t p, size_t b, size_t t, size_t h, size_t i) {
    /* per layer: [block][plane][token][head][dim] */
    return ((((l * KV_BLOCKS + b) * 2 + p) * TOKENS_PER_BLOCK + t) * KV_HEADS + h) * KV_DIM + i;
}

/* Polls until `want` completions of `request` arrived; returns how many
 * were LAKE_OK. */
static size_t wait_request(LakePool *pool, uint64_t request, size_t want) {
    size_t seen = 0, ok = 0;
    for (int round = 0; round < 5000 && seen < want; round++) {
        LakeCompletion done[16];
        size_t n = 0;
        if (lake_poll(pool, done, 16, &n) != LAKE_OK) return 0;
        for (size_t i = 0; i < n; i++) {
            if (done[i].request_id != request) continue;
            seen++;
            if (done[i].status == LAKE_OK) ok++;
        }
        if (n == 0) sleep_ms(2);
    }
    return ok;
}

/* Like wait_request, keeping each block's status. */
static int wait_request_statuses(LakePool *pool, uint64_t request, size_t want, LakeStatus *statuses) {
    size_t seen = 0;
    for (int round = 0; round < 5000 && seen < want; round++) {
        LakeCompletion done[16];
        size_t n = 0;
        if (lake_poll(pool, done, 16, &n) != LAKE_OK) return 0;
        for (size_t i = 0; i < n; i++) {
            if (done[i].request_id != request || done[i].index >= want) continue;
            statuses[done[i].index] = done[i].status;
            seen++;
        }
        if (n == 0) sleep_ms(2);
    }
    return seen == want;
}

/* The paged-KV part: returns after its checks (failures counted). */
static void kv_memory(const char *dp, const char *mirror, const char *cp, LakeNamespace *ns, LakePool *raw_pool,
                      const uint32_t *tokens) {
    LakeLayoutOptions layout;
    memset(&layout, 0, sizeof layout);
    layout.struct_size = sizeof layout;
    layout.layers = KV_LAYERS;
    layout.planes = 2;
    layout.kv_heads = 4;
    layout.shard_start = 2;
    layout.shard_end = 2 + KV_HEADS;
    layout.head_dim = KV_DIM;
    layout.dtype = 1; /* f16: two bytes an element */
    layout.block_tokens = TOKENS_PER_BLOCK;
    layout.layers_per_segment = 1;
    LakeLayoutInfo info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK(lake_layout_describe(&layout, &info) == LAKE_OK, "describe a layout");
    CHECK(info.block_bytes == (uint64_t)KV_LAYERS * 2 * TOKENS_PER_BLOCK * KV_HEADS * KV_DIM * 2,
          "block bytes %llu", (unsigned long long)info.block_bytes);
    CHECK(info.heads == KV_HEADS && info.head_bytes == KV_DIM * 2, "heads and head bytes");
    LakeLayoutOptions other_shard = layout;
    other_shard.shard_start = 0;
    other_shard.shard_end = KV_HEADS;
    LakeLayoutInfo other_info = info;
    CHECK(lake_layout_describe(&other_shard, &other_info) == LAKE_OK && other_info.fingerprint != info.fingerprint,
          "another shard, another fingerprint");
    uint64_t code = 0;
    CHECK(info.shard_code != 0 && other_info.shard_code != 0 && other_info.shard_code != info.shard_code,
          "each rank's heads their own shard code");
    CHECK(lake_shard_code(4, 2, 2 + KV_HEADS, &code) == LAKE_OK && code == info.shard_code,
          "a scheduler computes a rank's shard code from its heads");
    CHECK(lake_shard_code(4, 0, 4, &code) == LAKE_OK && code == 0, "every head: the whole block, code 0");
    CHECK(lake_shard_code(4, 3, 3, &code) == LAKE_INVALID_ARGUMENT, "an empty head range is refused");
    CHECK(lake_shard_code(4, 0, 4, NULL) == LAKE_NULL_ARGUMENT, "a null code is refused");
    LakeLayoutOptions bad = layout;
    bad.dtype = 77;
    CHECK(lake_layout_describe(&bad, &other_info) == LAKE_INVALID_ARGUMENT, "an unknown dtype is refused");
    bad = layout;
    bad.shard_end = 9;
    CHECK(lake_layout_describe(&bad, &other_info) == LAKE_INVALID_ARGUMENT, "a shard past the heads is refused");

    size_t elements = (size_t)KV_LAYERS * 2 * KV_BLOCKS * TOKENS_PER_BLOCK * KV_HEADS * KV_DIM;
    uint16_t *hnd = calloc(elements, sizeof(uint16_t));
    uint16_t *first = calloc(elements, sizeof(uint16_t));
    for (size_t i = 0; i < elements; i++) hnd[i] = (uint16_t)(i * 2654435761u >> 7);
    LakeKvPiece hnd_pieces[KV_LAYERS * 2], first_pieces[KV_LAYERS * 2];
    for (size_t l = 0; l < KV_LAYERS; l++) {
        for (size_t p = 0; p < 2; p++) {
            LakeKvPiece *a = &hnd_pieces[l * 2 + p], *b = &first_pieces[l * 2 + p];
            a->address = (uintptr_t)(hnd + hnd_index(l, p, 0, 0, 0, 0));
            a->block_stride = (int64_t)(hnd_index(l, p, 1, 0, 0, 0) - hnd_index(l, p, 0, 0, 0, 0)) * 2;
            a->token_stride = (int64_t)(hnd_index(l, p, 0, 1, 0, 0) - hnd_index(l, p, 0, 0, 0, 0)) * 2;
            a->head_stride = (int64_t)(hnd_index(l, p, 0, 0, 1, 0) - hnd_index(l, p, 0, 0, 0, 0)) * 2;
            b->address = (uintptr_t)(first + blocks_first_index(l, p, 0, 0, 0, 0));
            b->block_stride = (int64_t)(blocks_first_index(l, p, 1, 0, 0, 0) - blocks_first_index(l, p, 0, 0, 0, 0)) * 2;
            b->token_stride = (int64_t)(blocks_first_index(l, p, 0, 1, 0, 0) - blocks_first_index(l, p, 0, 0, 0, 0)) * 2;
            b->head_stride = (int64_t)(blocks_first_index(l, p, 0, 0, 1, 0) - blocks_first_index(l, p, 0, 0, 0, 0)) * 2;
        }
    }
    LakeKvMemoryOptions kv;
    memset(&kv, 0, sizeof kv);
    kv.struct_size = sizeof kv;
    kv.layout = &layout;
    kv.block_count = KV_BLOCKS;
    kv.pieces = hnd_pieces;
    kv.piece_count = KV_LAYERS * 2;
    uint32_t hnd_id = 0, first_id = 0;
    CHECK(lake_register_kv_memory(raw_pool, &kv, &hnd_id) == LAKE_LAYOUT_MISMATCH,
          "a pool attached under another layout refuses the memory");

    LakeAttachOptions options;
    memset(&options, 0, sizeof options);
    options.struct_size = sizeof options;
    options.dp_socket = dp;
    options.mirror_path = mirror;
    options.cp_socket = cp;
    options.name = "c-engine-kv";
    options.namespace_ = ns;
    options.layout_fingerprint = info.fingerprint;
    options.segment_bytes = info.segment_bytes;
    options.shard_code = info.shard_code;
    LakePool *pool = NULL;
    CHECK(lake_attach(&options, &pool) == LAKE_OK && pool != NULL, "attach under the layout");
    if (!pool) return;
    LakeAttachOptions too_big = options;
    too_big.block_bytes = (uint64_t)1 << 40;
    LakePool *refused = NULL;
    CHECK(lake_attach(&too_big, &refused) == LAKE_INVALID_ARGUMENT && refused == NULL,
          "a block no L1 size class holds is refused at attach");
    kv.piece_count = 3;
    CHECK(lake_register_kv_memory(pool, &kv, &hnd_id) == LAKE_INVALID_ARGUMENT, "a wrong piece count is refused");
    kv.piece_count = KV_LAYERS * 2;
    CHECK(lake_register_kv_memory(pool, &kv, &hnd_id) == LAKE_OK, "register the HND memory");
    kv.pieces = first_pieces;
    CHECK(lake_register_kv_memory(pool, &kv, &first_id) == LAKE_OK, "register the blocks-first memory");

    /* Another prompt's three blocks, from HND blocks 4, 1, 5 ... */
    LakeKeyChain *chain = NULL;
    LakeBlockKey keys[3];
    size_t written = 0;
    CHECK(lake_keychain_new(ns, &chain) == LAKE_OK, "key chain");
    uint32_t prompt[3 * TOKENS_PER_BLOCK];
    for (size_t i = 0; i < 3 * TOKENS_PER_BLOCK; i++) prompt[i] = tokens[i] + 100000;
    CHECK(lake_keychain_extend(chain, prompt, 3 * TOKENS_PER_BLOCK, keys, 3, &written) == LAKE_OK && written == 3,
          "keys");
    lake_keychain_free(chain);
    uint32_t from[3] = {4, 1, 5}, to[3] = {0, 3, 2};
    uint64_t request = 0;
    CHECK(lake_submit_save(pool, hnd_id, NULL, keys, from, 3, 2, &request) == LAKE_OK, "save from HND");
    CHECK(wait_request(pool, request, 3) == 3, "the three blocks saved");
    LakeLocation table[3];
    size_t hits = 0;
    for (int round = 0; round < 2000 && hits < 3; round++) {
        CHECK(lake_lookup(pool, keys, 3, table, 3, &hits) == LAKE_OK, "lookup");
        if (hits < 3) sleep_ms(2);
    }
    CHECK(hits == 3, "found (%zu)", hits);

    /* ... into blocks-first blocks 0, 3, 2: every element where it belongs. */
    CHECK(lake_submit_load(pool, first_id, keys, table, to, 3, 0, &request) == LAKE_OK, "load into blocks-first");
    CHECK(wait_request(pool, request, 3) == 3, "the three blocks loaded");
    size_t wrong = 0, stray = 0;
    for (size_t l = 0; l < KV_LAYERS; l++)
        for (size_t p = 0; p < 2; p++)
            for (size_t b = 0; b < KV_BLOCKS; b++)
                for (size_t t = 0; t < TOKENS_PER_BLOCK; t++)
                    for (size_t h = 0; h < KV_HEADS; h++)
                        for (size_t i = 0; i < KV_DIM; i++) {
                            uint16_t got = first[blocks_first_index(l, p, b, t, h, i)];
                            int k = b == 0 ? 0 : b == 3 ? 1 : b == 2 ? 2 : -1;
                            if (k < 0) {
                                stray += got != 0;
                            } else {
                                wrong += got != hnd[hnd_index(l, p, from[k], t, h, i)];
                            }
                        }
    CHECK(wrong == 0, "%zu elements misplaced", wrong);
    CHECK(stray == 0, "%zu elements written outside the loaded blocks", stray);

    /* The raw pool holds the whole block (no shard): it does not find this
     * rank's replicas, and handed their locations anyway, its load
     * completes LAKE_EVICTED (the slots hold another object than the one
     * its keys name) and writes nothing. */
    size_t raw_hits = 9;
    LakeLocation scratch[3];
    CHECK(lake_lookup(raw_pool, keys, 3, scratch, 3, &raw_hits) == LAKE_OK && raw_hits == 0,
          "a whole-block reader finds no shard's replica (%zu)", raw_hits);
    uint8_t *plain = calloc(1, info.block_bytes);
    uint32_t plain_id = 0;
    CHECK(lake_register_host_memory(raw_pool, plain, info.block_bytes, 1, &plain_id) == LAKE_OK, "plain memory");
    uint32_t zero[1] = {0};
    LakeStatus status[1] = {LAKE_OK};
    CHECK(lake_submit_load(raw_pool, plain_id, keys, table, zero, 1, 0, &request) == LAKE_OK, "foreign load");
    CHECK(wait_request_statuses(raw_pool, request, 1, status) && status[0] == LAKE_EVICTED,
          "another shard's replica completes LAKE_EVICTED (%d)", (int)status[0]);
    size_t touched = 0;
    for (size_t i = 0; i < info.block_bytes; i++) touched += plain[i] != 0;
    CHECK(touched == 0, "a foreign block wrote %zu bytes", touched);

    /* A pool of the same shard under another layout (another geometry of
     * the same heads) finds the blocks, and their bytes never: the load
     * completes LAKE_LAYOUT_MISMATCH. */
    LakeAttachOptions same_heads = options;
    same_heads.name = "c-engine-other-geometry";
    same_heads.layout_fingerprint = info.fingerprint ^ 1;
    LakePool *other = NULL;
    CHECK(lake_attach(&same_heads, &other) == LAKE_OK && other != NULL, "attach under another geometry");
    if (other) {
        uint32_t other_id = 0;
        CHECK(lake_register_host_memory(other, plain, info.block_bytes, 1, &other_id) == LAKE_OK, "plain memory");
        size_t other_hits = 0;
        CHECK(lake_lookup(other, keys, 3, table, 3, &other_hits) == LAKE_OK && other_hits == 3,
              "the same shard's keys are found (%zu)", other_hits);
        CHECK(lake_submit_load(other, other_id, keys, table, zero, 1, 0, &request) == LAKE_OK, "mismatched load");
        CHECK(wait_request_statuses(other, request, 1, status) && status[0] == LAKE_LAYOUT_MISMATCH,
              "another layout's block completes LAKE_LAYOUT_MISMATCH (%d)", (int)status[0]);
        touched = 0;
        for (size_t i = 0; i < info.block_bytes; i++) touched += plain[i] != 0;
        CHECK(touched == 0, "a mismatched block wrote %zu bytes", touched);
        lake_detach(other);
    }

    lake_detach(pool);
    free(plain);
    free(hnd);
    free(first);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s DP_SOCKET MIRROR CP_SOCKET BLOCK_BYTES\n", argv[0]);
        return 2;
    }
    size_t block_bytes = (size_t)strtoull(argv[4], NULL, 10);

    /* A namespace and the keys of a 8-block prompt, fed in two pieces. */
    LakeNamespaceOptions ns_options;
    memset(&ns_options, 0, sizeof ns_options);
    ns_options.struct_size = sizeof ns_options;
    memset(ns_options.tenant_key, 7, sizeof ns_options.tenant_key);
    ns_options.block_tokens = TOKENS_PER_BLOCK;
    memset(ns_options.model_fingerprint, 3, sizeof ns_options.model_fingerprint);
    LakeNamespace *ns = NULL;
    CHECK(lake_namespace_new(&ns_options, &ns) == LAKE_OK, "namespace");
    ns_options.struct_size = 3;
    LakeNamespace *bad_ns = NULL;
    CHECK(lake_namespace_new(&ns_options, &bad_ns) == LAKE_BAD_STRUCT_SIZE, "a bad struct_size is refused");
    CHECK(lake_namespace_new(NULL, &bad_ns) == LAKE_NULL_ARGUMENT, "a null options is refused");

    /* Engine page hashes (SGLang's): a namespace of key scheme 3 keys each
     * page from its hash alone. */
    LakeNamespaceOptions page_options = ns_options;
    page_options.struct_size = sizeof page_options;
    page_options.key_scheme = 3;
    LakeNamespace *page_ns = NULL;
    CHECK(lake_namespace_new(&page_options, &page_ns) == LAKE_OK, "a page-hash namespace");
    uint8_t hashes[3][32];
    for (int i = 0; i < 3; i++) memset(hashes[i], 0x40 + i, 32);
    LakeBlockKey page_keys[3], one_key[1];
    CHECK(lake_page_keys(page_ns, &hashes[0][0], 32, 3, page_keys) == LAKE_OK, "page keys");
    CHECK(lake_page_keys(page_ns, &hashes[2][0], 32, 1, one_key) == LAKE_OK &&
              memcmp(one_key, &page_keys[2], sizeof one_key) == 0,
          "a page's key needs nothing but its hash");
    CHECK(memcmp(&page_keys[0], &page_keys[1], sizeof page_keys[0]) != 0, "pages differ");
    CHECK(lake_page_keys(page_ns, &hashes[0][0], 0, 3, page_keys) == LAKE_INVALID_ARGUMENT, "empty hashes");
    CHECK(lake_page_keys(NULL, &hashes[0][0], 32, 1, one_key) ==
              LAKE_NULL_ARGUMENT, "a null namespace");
    LakeKeyChain *page_chain = NULL;
    CHECK(lake_keychain_new(page_ns, &page_chain) == LAKE_OK, "a chain over a page-hash namespace");
    size_t none = 0;
    uint32_t some_tokens[TOKENS_PER_BLOCK] = {0};
    CHECK(lake_keychain_extend(page_chain, some_tokens, TOKENS_PER_BLOCK, one_key, 1, &none) == LAKE_INVALID_ARGUMENT,
          "token keys in a page-hash namespace are refused");
    lake_keychain_free(page_chain);
    page_options.key_scheme = 2;
    LakeNamespace *refused = NULL;
    CHECK(lake_namespace_new(&page_options, &refused) == LAKE_INVALID_ARGUMENT, "an unknown key scheme");
    lake_namespace_free(page_ns);

    uint32_t tokens[BLOCKS * TOKENS_PER_BLOCK + 5];
    for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) tokens[i] = (uint32_t)(i * 7919 % 151936);
    LakeKeyChain *chain = NULL;
    CHECK(lake_keychain_new(ns, &chain) == LAKE_OK, "key chain");
    LakeBlockKey keys[BLOCKS];
    size_t written = 0, total = 0;
    CHECK(lake_keychain_extend(chain, tokens, 40, keys, BLOCKS, &written) == LAKE_OK && written == 2,
          "40 tokens: 2 blocks, 8 tokens wait (got %zu)", written);
    total = written;
    CHECK(lake_keychain_extend(chain, tokens + 40, 1, keys + total, 0, &written) == LAKE_OK && written == 0,
          "one more token completes nothing");
    LakeBlockKey few[1];
    CHECK(lake_keychain_extend(chain, tokens + 41, 100, few, 1, &written) == LAKE_BUFFER_TOO_SMALL && written == 6,
          "too little room says how much (got %zu)", written);
    CHECK(lake_keychain_extend(chain, tokens + 41, sizeof tokens / sizeof tokens[0] - 41, keys + total,
                               BLOCKS - total, &written) == LAKE_OK && written == 6,
          "the rest: 6 blocks (got %zu)", written);

    /* Attach. */
    LakeAttachOptions options;
    memset(&options, 0, sizeof options);
    options.struct_size = sizeof options;
    options.dp_socket = argv[1];
    options.mirror_path = argv[2];
    options.cp_socket = argv[3];
    options.name = "c-engine";
    options.namespace_ = ns;
    options.layout_fingerprint = 0x5eed;
    options.segment_bytes = 4096;
    LakePool *pool = NULL;
    LakeAttachOptions no_socket = options;
    no_socket.dp_socket = "/nonexistent/lake.sock";
    CHECK(lake_attach(&no_socket, &pool) == LAKE_NOT_ATTACHED, "no daemon there");
    LakeAttachOptions far_core = options;
    far_core.pin_agent = 1;
    far_core.agent_core = 100000;
    CHECK(lake_attach(&far_core, &pool) == LAKE_INVALID_ARGUMENT, "a core this process cannot run on");
    options.pin_agent = 1;
    options.agent_core = 0; /* every machine has a core 0 */
    CHECK(lake_attach(&options, &pool) == LAKE_OK && pool != NULL, "attach");
    if (!pool) return 1;
    CHECK(lake_alive(pool) == LAKE_OK, "alive");

    /* Engine memory: 2 × BLOCKS blocks; the first BLOCKS hold the KV. */
    uint8_t *memory = malloc(block_bytes * BLOCKS * 2);
    for (size_t b = 0; b < BLOCKS; b++)
        for (size_t i = 0; i < block_bytes; i++) memory[b * block_bytes + i] = (uint8_t)(b * 31 + i * 7);
    uint32_t memory_id = 99;
    CHECK(lake_register_host_memory(pool, memory, block_bytes, BLOCKS * 2, &memory_id) == LAKE_OK, "register");

    uint32_t saved_blocks[BLOCKS], loaded_blocks[BLOCKS];
    for (uint32_t b = 0; b < BLOCKS; b++) {
        saved_blocks[b] = b;
        loaded_blocks[b] = BLOCKS + b;
    }
    uint64_t request = 0;
    CHECK(lake_submit_save(pool, memory_id + 5, NULL, keys, saved_blocks, BLOCKS, 2, &request) ==
              LAKE_INVALID_ARGUMENT, "an unknown memory id is refused");
    uint32_t outside[1] = {1000};
    CHECK(lake_submit_save(pool, memory_id, NULL, keys, outside, 1, 2, &request) == LAKE_INVALID_ARGUMENT,
          "a block outside the memory is refused");
    CHECK(lake_submit_save_on_stream(pool, memory_id, NULL, keys, saved_blocks, BLOCKS, 9, 0, &request) ==
              LAKE_INVALID_ARGUMENT, "an unknown priority is refused on the stream call too");
    /* Host memory: the stream plays no part. */
    CHECK(lake_submit_save_on_stream(pool, memory_id, NULL, keys, saved_blocks, BLOCKS, 2, 0, &request) == LAKE_OK,
          "save");
    CHECK(wait_request(pool, request, BLOCKS) == BLOCKS, "every block saved");

    /* Found in the mirror once published. */
    LakeLocation table[BLOCKS];
    size_t hits = 0;
    for (int round = 0; round < 2000; round++) {
        CHECK(lake_lookup(pool, keys, BLOCKS, table, BLOCKS, &hits) == LAKE_OK, "lookup");
        if (hits == BLOCKS) break;
        sleep_ms(2);
    }
    CHECK(hits == BLOCKS, "all %d blocks found (got %zu)", BLOCKS, hits);
    CHECK(table[0].tier == 1, "in L1");
    CHECK(lake_lookup(pool, keys, BLOCKS, table, 2, &hits) == LAKE_BUFFER_TOO_SMALL && hits == BLOCKS,
          "a small table says how much");
    CHECK(lake_lookup(pool, NULL, BLOCKS, table, BLOCKS, &hits) == LAKE_NULL_ARGUMENT, "null keys refused");

    /* Loaded back into the other half, byte for byte. */
    memset(memory + block_bytes * BLOCKS, 0, block_bytes * BLOCKS);
    CHECK(lake_submit_load(pool, memory_id, keys, table, loaded_blocks, BLOCKS, 0, &request) == LAKE_OK, "load");
    CHECK(wait_request(pool, request, BLOCKS) == BLOCKS, "every block loaded");
    CHECK(memcmp(memory, memory + block_bytes * BLOCKS, block_bytes * BLOCKS) == 0, "the bytes came back");

    /* Priorities: an unknown one is refused; a prefetch (2) loads too. */
    CHECK(lake_submit_load(pool, memory_id, keys, table, loaded_blocks, BLOCKS, 9, &request) == LAKE_INVALID_ARGUMENT,
          "an unknown priority is refused");
    memset(memory + block_bytes * BLOCKS, 0, block_bytes * BLOCKS);
    CHECK(lake_submit_load(pool, memory_id, keys, table, loaded_blocks, BLOCKS, 2, &request) == LAKE_OK, "prefetch");
    CHECK(wait_request(pool, request, BLOCKS) == BLOCKS, "every block prefetched");
    CHECK(memcmp(memory, memory + block_bytes * BLOCKS, block_bytes * BLOCKS) == 0, "prefetched bytes");

    /* A lease on the prompt's replicas, held, then released. */
    LakeLease *lease = NULL;
    size_t leased = 0;
    uint64_t deadline = 0;
    CHECK(lake_lease(pool, keys, BLOCKS, 5000, &leased, &deadline, &lease) == LAKE_OK && lease != NULL, "lease");
    CHECK(leased == BLOCKS, "every block leased (%zu)", leased);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t now_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    CHECK(deadline > now_ns && deadline < now_ns + 6000000000ull, "the deadline is about 5 s away");
    lake_lease_release(lease);
    lake_lease_release(NULL);
    CHECK(lake_lease(pool, keys, BLOCKS, 0, &leased, &deadline, &lease) == LAKE_INVALID_ARGUMENT, "a zero ttl");
    CHECK(lake_lease(pool, keys, BLOCKS, 1000, NULL, &deadline, &lease) == LAKE_NULL_ARGUMENT, "a null out");

    /* Pinned: the L1 hits stay put until released, and load in this
     * thread with no queue. */
    LakePins *pins = NULL;
    size_t pinned_hits = 0;
    CHECK(lake_lookup_pinned(pool, keys, BLOCKS, table, BLOCKS, &pinned_hits, &pins) == LAKE_OK && pins != NULL &&
              pinned_hits == BLOCKS, "pinned lookup (%zu hits)", pinned_hits);
    memset(memory + block_bytes * BLOCKS, 0, block_bytes * BLOCKS);
    LakeStatus statuses[BLOCKS];
    CHECK(lake_load_pinned(pool, pins, memory_id, loaded_blocks, BLOCKS, statuses) == LAKE_OK, "pinned load");
    for (size_t b = 0; b < BLOCKS; b++) CHECK(statuses[b] == LAKE_OK, "pinned block %zu: %d", b, (int)statuses[b]);
    CHECK(memcmp(memory, memory + block_bytes * BLOCKS, block_bytes * BLOCKS) == 0, "pinned bytes came back");
    CHECK(lake_load_pinned(pool, pins, memory_id, loaded_blocks, BLOCKS + 1, statuses) == LAKE_INVALID_ARGUMENT,
          "more blocks than pinned is refused");
    lake_pins_release(pins);
    lake_pins_release(NULL);

    /* A stale location (a generation that is gone) loads nothing wrong. */
    LakeLocation stale[1] = {table[0]};
    stale[0].generation += 1000;
    memset(memory + block_bytes * BLOCKS, 0, block_bytes);
    CHECK(lake_submit_load(pool, memory_id, keys, stale, loaded_blocks, 1, 0, &request) == LAKE_OK, "stale load");
    CHECK(wait_request(pool, request, 1) == 0, "a stale location completes with an error");
    for (size_t i = 0; i < block_bytes; i++) {
        if (memory[block_bytes * BLOCKS + i] != 0) {
            CHECK(0, "a failed load wrote engine memory");
            break;
        }
    }

    LakeStats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats;
    CHECK(lake_stats(pool, &stats) == LAKE_OK && stats.saves == BLOCKS && stats.l1_loads >= BLOCKS,
          "stats (saves %llu, l1 loads %llu)", (unsigned long long)stats.saves, (unsigned long long)stats.l1_loads);

    char message[64];
    lake_submit_load(NULL, 0, NULL, NULL, NULL, 0, 0, NULL);
    CHECK(lake_last_error(message, sizeof message) > 0, "an error message is kept");

    kv_memory(argv[1], argv[2], argv[3], ns, pool, tokens);

    lake_detach(pool);
    lake_keychain_free(chain);
    lake_namespace_free(ns);
    free(memory);
    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("OK\n");
    return 0;
}
