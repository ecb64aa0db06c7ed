/*
 * Unit tests: node validation (tree-checker), corruption reporting, cache
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "core-test.h"

#define BS 512
#define NS 4096

/* A valid extent-tree leaf image at @bytenr with @nr ZERO items */
static uint8_t *make_leaf(uint64_t bytenr, uint64_t gen, int nr)
{
    uint8_t *buf = g_malloc0(NS);
    ExtreeNode v = { .buf = buf };

    ext_st32(buf + EXT_NH_MAGIC, EXTREE_NODE_MAGIC);
    ext_st64(buf + EXT_NH_BYTENR, bytenr);
    ext_st64(buf + EXT_NH_GEN, gen);
    ext_st32(buf + EXT_NH_OWNER, EXTREE_TREE_EXTENT);
    node_set_nritems(&v, nr);
    for (int i = 0; i < nr; i++) {
        ExtreeItem it = { i * 4 * BS, 2 * BS, 0, EXTREE_ITEM_ZERO };
        leaf_set(&v, i, &it);
    }
    ext_st32(buf, extree_crc32c(0, buf + 4, NS - 4));
    return buf;
}

static void expect_leaf(ExtreeNodeExpect *e, uint64_t gen)
{
    e->owner = EXTREE_TREE_EXTENT;
    e->level = 0;
    e->generation = gen;
    e->has_first_key = false;
    e->first_key = 0;
    e->key_end = UINT64_MAX;
    e->has_bytes = false;
    e->bytes = 0;
    e->data_end = UINT64_MAX;
}

static void assert_invalid(Extree *t, uint8_t *buf, uint64_t bytenr,
                           ExtreeNodeExpect *e, const char *reason)
{
    char *why = NULL;

    ext_st32(buf, extree_crc32c(0, buf + 4, NS - 4));
    g_assert_cmpint(extree_node_validate(t, buf, bytenr, e, &why), ==, -EIO);
    g_assert_nonnull(why);
    if (!strstr(why, reason)) {
        g_error("have \"%s\", want \"%s\"", why, reason);
    }
    g_free(why);
}

static void test_validate(void)
{
    ExtreeBackend *be = ct_create(1 << 20, BS, NS);
    Extree *t = ct_open(be);
    uint64_t at = extree_data_start(t);
    int cap = EXTREE_LEAF_CAPACITY(NS);
    ExtreeNodeExpect e;
    ExtreeNode v;
    ExtreeItem it;
    char *why = NULL;
    uint8_t *buf;

    expect_leaf(&e, 5);
    buf = make_leaf(at, 5, 10);
    g_assert_cmpint(extree_node_validate(t, buf, at, &e, &why), ==, 0);
    g_assert_null(why);

    /* bad checksum: computed value named */
    buf[100] ^= 1;
    g_assert_cmpint(extree_node_validate(t, buf, at, &e, &why), ==, -EIO);
    g_assert_true(g_str_has_prefix(why, "bad checksum, have 0x"));
    g_assert_nonnull(strstr(why, " expect 0x"));
    g_free(why);
    g_free(buf);

    /* a node read from the wrong place */
    buf = make_leaf(at, 5, 10);
    assert_invalid(t, buf, at + NS, &e, "bad bytenr, have 0x");
    /* wrong owner, level, generation */
    e.owner = EXTREE_TREE_FREE;
    assert_invalid(t, buf, at, &e, "bad owner, have 1 expect 2");
    expect_leaf(&e, 5);
    e.level = 1;
    assert_invalid(t, buf, at, &e, "bad level, have 0 expect 1");
    expect_leaf(&e, 6);
    assert_invalid(t, buf, at, &e, "bad generation, have 5 expect 6");
    expect_leaf(&e, 5);
    g_free(buf);

    /* too many items */
    buf = make_leaf(at, 5, 10);
    v.buf = buf;
    node_set_nritems(&v, cap + 1);
    assert_invalid(t, buf, at, &e, "too many items");
    g_free(buf);

    /* unsorted and overlapping keys */
    buf = make_leaf(at, 5, 10);
    v.buf = buf;
    leaf_get(&v, 3, &it);
    it.key = 0;
    leaf_set(&v, 3, &it);
    assert_invalid(t, buf, at, &e, "unsorted or overlapping items at slot 3");
    g_free(buf);
    buf = make_leaf(at, 5, 10);
    v.buf = buf;
    leaf_get(&v, 3, &it);
    it.length = 8 * BS;
    leaf_set(&v, 3, &it);
    assert_invalid(t, buf, at, &e, "unsorted or overlapping items at slot 4");
    g_free(buf);

    /* item fields */
    buf = make_leaf(at, 5, 10);
    v.buf = buf;
    it = (ExtreeItem){ 0, 100, 0, EXTREE_ITEM_ZERO };
    leaf_set(&v, 0, &it);
    assert_invalid(t, buf, at, &e, "not a non-empty multiple of block size");
    it = (ExtreeItem){ 0, BS, 0, 9 };
    leaf_set(&v, 0, &it);
    assert_invalid(t, buf, at, &e, "bad item type at slot 0, have 9");
    it = (ExtreeItem){ 0, BS, BS, EXTREE_ITEM_ZERO };
    leaf_set(&v, 0, &it);
    assert_invalid(t, buf, at, &e, "bad zero item");
    it = (ExtreeItem){ 0, BS, 1 << 30, EXTREE_ITEM_DATA };
    leaf_set(&v, 0, &it);
    assert_invalid(t, buf, at, &e, "bad host range at slot 0");
    g_free(buf);
    buf = make_leaf(at, 5, 10);
    v.buf = buf;
    it = (ExtreeItem){ 36 * BS, 1 << 21, 0, EXTREE_ITEM_ZERO };
    leaf_set(&v, 9, &it);
    assert_invalid(t, buf, at, &e, "beyond virtual size");
    g_free(buf);

    /* parent agreement: first key and key range */
    buf = make_leaf(at, 5, 10);
    e.has_first_key = true;
    e.first_key = BS;
    assert_invalid(t, buf, at, &e, "first key mismatch, have 0x0 expect 0x200");
    e.first_key = 0;
    e.key_end = 8 * BS;
    assert_invalid(t, buf, at, &e, "item beyond parent range at slot 2");
    /* only a root leaf may be empty */
    e.key_end = UINT64_MAX;
    v.buf = buf;
    node_set_nritems(&v, 0);
    assert_invalid(t, buf, at, &e, "empty non-root leaf");
    g_free(buf);

    /* parent agreement: child_bytes (10 items of 2 blocks) */
    buf = make_leaf(at, 5, 10);
    e.has_bytes = true;
    e.bytes = 20 * BS - BS;
    assert_invalid(t, buf, at, &e,
                   "subtree bytes mismatch, have 0x2800 expect 0x2600");
    e.bytes = 20 * BS;
    ext_st32(buf, extree_crc32c(0, buf + 4, NS - 4));
    g_assert_cmpint(extree_node_validate(t, buf, at, &e, &why), ==, 0);
    e.has_bytes = false;
    g_free(buf);

    /* interior nodes */
    buf = make_leaf(at, 5, 0);
    v.buf = buf;
    buf[EXT_NH_LEVEL] = 1;
    node_set_nritems(&v, 2);
    ptr_set(&v, 0, &(ExtreeKeyPtr){ 0, at, 5, BS });
    ptr_set(&v, 1, &(ExtreeKeyPtr){ 0, at + NS, 5, BS });
    expect_leaf(&e, 5);
    e.level = 1;
    assert_invalid(t, buf, at, &e, "unsorted keys at slot 1");
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + 3, 5, BS });
    assert_invalid(t, buf, at, &e, "bad child pointer at slot 1");
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 6, BS });
    assert_invalid(t, buf, at, &e, "bad child generation at slot 1");
    /* child_bytes: non-zero, whole blocks, within the child's key range */
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 4, 0 });
    assert_invalid(t, buf, at, &e, "bad child_bytes at slot 1, have 0x0");
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 4, BS + 1 });
    assert_invalid(t, buf, at, &e, "bad child_bytes at slot 1");
    ptr_set(&v, 0, &(ExtreeKeyPtr){ 0, at, 5, 2 * BS });
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 4, BS });
    assert_invalid(t, buf, at, &e, "bad child_bytes at slot 0, have 0x400");
    ptr_set(&v, 0, &(ExtreeKeyPtr){ 0, at, 5, BS });
    e.key_end = 4 * BS;
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 4, 3 * BS + BS });
    assert_invalid(t, buf, at, &e, "bad child_bytes at slot 1, have 0x800");
    /* and their sum is what the node's own parent says */
    ptr_set(&v, 1, &(ExtreeKeyPtr){ BS, at + NS, 4, 3 * BS });
    e.has_bytes = true;
    e.bytes = 3 * BS;
    assert_invalid(t, buf, at, &e,
                   "subtree bytes mismatch, have 0x800 expect 0x600");
    e.bytes = 4 * BS;
    ext_st32(buf, extree_crc32c(0, buf + 4, NS - 4));
    g_assert_cmpint(extree_node_validate(t, buf, at, &e, &why), ==, 0);
    g_free(buf);

    extree_close(t);
    extree_mem_backend_free(be);
}

typedef struct Seen {
    int calls;
    uint64_t offset;
    char *msg;
} Seen;

static void on_corrupt(void *opaque, uint64_t offset, const char *msg)
{
    Seen *s = opaque;
    s->calls++;
    s->offset = offset;
    g_free(s->msg);
    s->msg = g_strdup(msg);
}

/*
 * Damage on disk: -EIO and one message naming the structure and offset,
 * never a crash
 */
static void test_corrupt_reporting(void)
{
    ExtreeBackend *be = ct_create(1 << 22, BS, NS);
    Extree *t = ct_open(be);
    ExtreeDiskSuper sb;
    ExtreeOpenOptions o = { 0 };
    ExtreeDamage damage = EXTREE_DAMAGE_NONE;
    Seen seen = { 0 };
    ExtreeCorruption c;
    ExtreeRun runs[4];
    uint64_t root, leaf;
    char *err = NULL, *want;
    uint8_t *buf;
    int n;

    for (int i = 0; i < 400; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    g_assert_cmpint(extree_commit(t), ==, 0);
    g_assert_cmpuint(extree_depth(t), ==, 2);
    extree_close(t);

    /* damage the second leaf */
    ct_read_super(be, &sb);
    root = GUINT64_FROM_LE(sb.extent_root.bytenr);
    buf = ct_node_read(be, root, NS);
    leaf = GUINT64_FROM_LE(((ExtreeDiskKeyPtr *)(buf + 64))[1].child);
    g_free(buf);
    buf = ct_node_read(be, leaf, NS);
    buf[200] ^= 0x40;
    ct_node_write(be, leaf, buf, NS, false);
    g_free(buf);

    t = ct_open(be);
    extree_set_corrupt_handler(t, on_corrupt, &seen);
    g_assert_cmpint(extree_lookup(t, 0, BS, runs, 4, &n), ==, 0);
    g_assert_cmpint(extree_lookup(t, 300 * BS, BS, runs, 4, &n), ==, -EIO);
    g_assert_cmpint(seen.calls, ==, 1);
    g_assert_cmphex(seen.offset, ==, leaf);
    want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                           ": bad checksum, have 0x", leaf);
    g_assert_true(g_str_has_prefix(seen.msg, want));
    g_assert_cmpstr(extree_last_error(t), ==, seen.msg);
    g_free(want);
    /* again: again -EIO, no crash; writes there fail too */
    g_assert_cmpint(extree_lookup(t, 300 * BS, BS, runs, 4, &n), ==, -EIO);
    g_assert_cmpint(extree_punch(t, 300 * BS, BS), ==, -EIO);

    /*
     * The first damage waits for the caller (the driver and the plugin
     * take it the same way); fatal only for a writer of an unmarked image
     */
    g_assert_true(extree_corruption_pending(t));
    g_assert_true(extree_take_corruption(t, true, &c));
    g_assert_cmphex(c.offset, ==, leaf);
    g_assert_cmpstr(c.msg, ==, seen.msg);
    g_assert_true(c.fatal);
    g_free(c.msg);
    g_assert_false(extree_corruption_pending(t));
    g_assert_false(extree_take_corruption(t, true, &c));
    g_assert_cmpint(extree_lookup(t, 300 * BS, BS, runs, 4, &n), ==, -EIO);
    g_assert_true(extree_take_corruption(t, false, &c));
    g_assert_false(c.fatal);
    g_free(c.msg);
    g_assert_cmpint(extree_lookup(t, 300 * BS, BS, runs, 4, &n), ==, -EIO);
    extree_drop_corruption(t);
    g_assert_false(extree_corruption_pending(t));
    extree_close(t);

    /* damage the root: open fails with the message */
    buf = ct_node_read(be, root, NS);
    ext_st32(buf + EXT_NH_OWNER, EXTREE_TREE_FREE);
    ct_node_write(be, root, buf, NS, true);
    g_free(buf);
    o.damage = &damage;
    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, -EIO);
    want = g_strdup_printf("corrupt extent tree node at offset 0x%" PRIx64
                           ": bad owner, have 2 expect 1", root);
    g_assert_cmpstr(err, ==, want);
    /* classified by the code the core found it with, not by the text */
    g_assert_cmpint(damage, ==, EXTREE_DAMAGE_CORRUPT);
    g_free(want);
    g_free(err);

    /* the file cut before the root: truncated, not corrupt */
    g_assert_cmpint(be->ops->truncate(be->opaque, root), ==, 0);
    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, -EIO);
    g_assert_true(g_str_has_prefix(err, "truncated image: "));
    g_assert_cmpint(damage, ==, EXTREE_DAMAGE_TRUNCATED);
    g_free(err);

    /* neither superblock valid: damage */
    buf = g_malloc0(2 * EXTREE_SB_SIZE);
    g_assert_cmpint(be->ops->pwrite(be->opaque, 0, buf, 2 * EXTREE_SB_SIZE),
                    ==, 0);
    g_free(buf);
    g_assert_cmpint(extree_open(be, &o, &t, &err), <, 0);
    g_assert_cmpint(damage, ==, EXTREE_DAMAGE_CORRUPT);
    g_free(err);
    g_free(seen.msg);
    extree_mem_backend_free(be);

    /* a sound image: nothing */
    be = ct_create(1 << 22, BS, NS);
    damage = EXTREE_DAMAGE_CORRUPT;
    g_assert_cmpint(extree_open(be, &o, &t, &err), ==, 0);
    g_assert_cmpint(damage, ==, EXTREE_DAMAGE_NONE);
    extree_close(t);
    extree_mem_backend_free(be);
}

/* Dirty nodes stay (pinned) above the cache bound until commit */
static void test_dirty_pinned(void)
{
    ExtreeBackend *be = ct_create(1 << 24, BS, NS);
    Extree *t = ct_open_opts(be, false, 32 * NS, 1 << 30);
    ExtreeStats st;

    for (int i = 0; i < 8000; i++) {
        ct_write(t, 2 * i * BS, BS);
    }
    extree_stats(t, &st);
    g_assert_cmpuint(st.dirty_nodes, >, 32);
    g_assert_cmpuint(st.cached_nodes, >=, st.dirty_nodes);
    g_assert_cmpint(extree_commit(t), ==, 0);
    extree_stats(t, &st);
    g_assert_cmpuint(st.dirty_nodes, ==, 0);
    g_assert_cmpuint(st.cached_nodes, <=, 32);
    ct_check_clean(t, NULL);
    extree_close(t);
    extree_mem_backend_free(be);
}

int main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add_func("/node/validate", test_validate);
    g_test_add_func("/node/corrupt-reporting", test_corrupt_reporting);
    g_test_add_func("/node/dirty-pinned", test_dirty_pinned);
    return g_test_run();
}
