/*
 * extree core: a new image (extree_create()) and the checks of what it is
 * created with
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "extree-int.h"

int extree_check_backing(const char *file, const char *fmt, char **errmsg)
{
    if (fmt && *fmt && !(file && *file)) {
        *errmsg = g_strdup("Backing format cannot be used without backing "
                           "file");
        return -EINVAL;
    }
    if (file && strlen(file) > EXTREE_BACKING_FILE_MAX) {
        *errmsg = g_strdup_printf("Backing file name too long (at most %d "
                                  "bytes)", EXTREE_BACKING_FILE_MAX);
        return -EINVAL;
    }
    if (fmt && strlen(fmt) > EXTREE_BACKING_FMT_MAX) {
        *errmsg = g_strdup_printf("Backing format name too long (at most %d "
                                  "bytes)", EXTREE_BACKING_FMT_MAX);
        return -EINVAL;
    }
    return 0;
}

/* The encryption header: its length is the caller's (the LUKS driver's) */
static int check_crypt(const ExtreeCreateParams *p, char **errmsg)
{
    if (p->crypt_method == EXTREE_CRYPT_NONE) {
        if (p->crypt_header_length) {
            *errmsg = g_strdup("An encryption header length needs an "
                               "encryption method");
            return -EINVAL;
        }
        return 0;
    }
    if (p->crypt_method != EXTREE_CRYPT_LUKS) {
        *errmsg = g_strdup_printf("Unknown encryption method %u",
                                  p->crypt_method);
        return -EINVAL;
    }
    if (p->crypt_header_length == 0) {
        *errmsg = g_strdup("Encrypted images need an encryption header "
                           "length");
        return -EINVAL;
    }
    if (!EXTREE_IS_ALIGNED(p->crypt_header_length,
                           EXTREE_CRYPT_HEADER_ALIGN)) {
        *errmsg = g_strdup_printf("Encryption header length (%" PRIu64
                                  ") must be a multiple of %d bytes",
                                  p->crypt_header_length,
                                  EXTREE_CRYPT_HEADER_ALIGN);
        return -EINVAL;
    }
    if (p->crypt_header_length > EXTREE_CRYPT_HEADER_MAX) {
        *errmsg = g_strdup_printf("Encryption header length (%" PRIu64
                                  ") must be at most %d bytes",
                                  p->crypt_header_length,
                                  EXTREE_CRYPT_HEADER_MAX);
        return -EINVAL;
    }
    return 0;
}

int extree_create_check(const ExtreeCreateParams *p, char **errmsg)
{
    uint32_t bs = p->block_size ? p->block_size : EXTREE_DEFAULT_BLOCK_SIZE;
    uint32_t ns = p->node_size ? p->node_size : EXTREE_DEFAULT_NODE_SIZE;
    int ret;

    *errmsg = NULL;
    if (p->virtual_size > EXTREE_MAX_VIRTUAL_SIZE) {
        *errmsg = g_strdup_printf("Image size must be at most %" PRIu64
                                  " bytes", (uint64_t)EXTREE_MAX_VIRTUAL_SIZE);
        return -EINVAL;
    }
    if (p->virtual_size % 512) {
        *errmsg = g_strdup("Image size must be a multiple of 512 bytes");
        return -EINVAL;
    }
    /* a block never exceeds its node, so nodes bound blocks too */
    if (!extree_is_pow2_in(bs, EXTREE_MIN_BLOCK_SIZE,
                    MIN(EXTREE_MAX_BLOCK_SIZE, EXTREE_MAX_NODE_SIZE))) {
        *errmsg = g_strdup_printf("Block size must be a power of two between "
                                  "%d and %d bytes", EXTREE_MIN_BLOCK_SIZE,
                                  MIN(EXTREE_MAX_BLOCK_SIZE,
                                      EXTREE_MAX_NODE_SIZE));
        return -EINVAL;
    }
    if (!extree_is_pow2_in(ns, EXTREE_MIN_NODE_SIZE, EXTREE_MAX_NODE_SIZE)) {
        *errmsg = g_strdup_printf("Node size must be a power of two between "
                                  "%d and %d bytes", EXTREE_MIN_NODE_SIZE,
                                  EXTREE_MAX_NODE_SIZE);
        return -EINVAL;
    }
    if (ns < bs) {
        *errmsg = g_strdup_printf("Node size (%u) must not be smaller than "
                                  "the block size (%u)", ns, bs);
        return -EINVAL;
    }
    ret = check_crypt(p, errmsg);
    if (ret < 0) {
        return ret;
    }
    if (p->compression_type > EXTREE_COMPRESS_ZSTD) {
        *errmsg = g_strdup_printf("Unknown compression type %u",
                                  p->compression_type);
        return -EINVAL;
    }
    return extree_check_backing(p->backing_file, p->backing_fmt, errmsg);
}

/*
 * Create: two empty leaf roots at data_start (right after the superblocks,
 * or after the encryption header), then the superblock (generation 1) in
 * both slots, so that a torn first commit (generation 2, slot 0) still
 * falls back to generation 1 in slot 1.  Nothing is written, truncated or
 * discarded in [8192, data_start): the caller may have written the
 * encryption header there already.
 */
int extree_create(ExtreeBackend *be, const ExtreeCreateParams *p,
                  char **errmsg)
{
    uint32_t bs = p->block_size ? p->block_size : EXTREE_DEFAULT_BLOCK_SIZE;
    uint32_t ns = p->node_size ? p->node_size : EXTREE_DEFAULT_NODE_SIZE;
    uint64_t data_start;
    ExtreeSuper s, check;
    uint8_t *node, *buf;
    char *why = NULL;
    bool sum_ok;
    int ret;

    ret = extree_create_check(p, errmsg);
    if (ret < 0) {
        return ret;
    }

    memset(&s, 0, sizeof(s));
    s.generation = 1;
    s.virtual_size = p->virtual_size;
    s.block_size = bs;
    s.node_size = ns;
    if (p->crypt_method != EXTREE_CRYPT_NONE) {
        s.incompat |= EXTREE_INCOMPAT_ENCRYPTED;
        s.crypt_method = p->crypt_method;
        s.crypt_header_offset = EXTREE_CRYPT_HEADER_OFFSET;
        s.crypt_header_length = p->crypt_header_length;
    }
    s.compression_type = p->compression_type;
    data_start = extree_sb_data_start(&s);
    s.host_end = data_start + 2 * (uint64_t)ns;
    /* the extent tree's root first, then the free tree's */
    EXT_FOR_EACH_TREE(o) {
        s.root[o] = data_start + (o - EXTREE_TREE_EXTENT) * (uint64_t)ns;
        s.root_gen[o] = 1;
    }
    g_strlcpy(s.backing_file, p->backing_file ? p->backing_file : "",
              sizeof(s.backing_file));
    g_strlcpy(s.backing_fmt, p->backing_fmt ? p->backing_fmt : "",
              sizeof(s.backing_fmt));

    node = g_malloc0(ns);
    buf = g_malloc(EXTREE_SB_SIZE);
    EXT_FOR_EACH_TREE(o) {
        if (ret < 0) {
            break;
        }
        memset(node, 0, ns);
        ext_st32(node + EXT_NH_MAGIC, EXTREE_NODE_MAGIC);
        ext_st64(node + EXT_NH_BYTENR, s.root[o]);
        ext_st64(node + EXT_NH_GEN, 1);
        ext_st32(node + EXT_NH_OWNER, o);
        ext_st32(node + EXT_NH_CSUM,
                 extree_crc32c(0, node + EXT_NH_MAGIC, ns - EXT_NH_MAGIC));
        ret = be->ops->pwrite(be->opaque, s.root[o], node, ns);
    }
    if (ret == 0) {
        ret = be->ops->flush(be->opaque);
    }
    extree_sb_encode(&s, buf);
    if (ret == 0 && extree_sb_decode(buf, &check, &why, &sum_ok) < 0) {
        /* create's own checks above must have caught this */
        *errmsg = g_strdup_printf("Invalid new superblock: %s", why);
        g_free(why);
        g_free(node);
        g_free(buf);
        return -EINVAL;
    }
    for (int slot = 0; slot < 2 && ret == 0; slot++) {
        ret = be->ops->pwrite(be->opaque, slot * EXTREE_SB_SIZE, buf,
                              EXTREE_SB_SIZE);
    }
    if (ret == 0) {
        ret = be->ops->flush(be->opaque);
    }
    g_free(node);
    g_free(buf);
    if (ret < 0) {
        *errmsg = g_strdup_printf("Could not write the new image: %s",
                                  g_strerror(-ret));
    }
    return ret;
}
