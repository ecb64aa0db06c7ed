/*
 * extree driver: LUKS encryption of guest data
 *
 * The core knows only where the LUKS header lies (spec: Encryption); the
 * header itself and every sector of guest data are QEMU's crypto layer's
 * business (crypto/block-luks.c), as in qcow2.  The IV of a sector is
 * derived from its guest offset, not its host offset: a DATA extent that
 * a snapshot shares, or that moves to new space with the rest of its
 * block, stays valid as it is.
 *
 * Copyright (c) 2026 extree developers
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "block/block_int.h"
#include "block/qdict.h"
#include "block/thread-pool.h"
#include "crypto.h"
#include "crypto/block.h"
#include "qapi/error.h"
#include "qemu/bswap.h"
#include "qemu/memalign.h"
#include "qobject/qdict.h"
#include "system/block-backend.h"
#include "trace/trace-block_extree.h"
#include "extree-qemu.h"

/* ---- The header, at [crypt_hdr_offset, + crypt_hdr_len) ---- */

/* The crypto layer's header I/O stays inside the header (its lengths) */
static bool xt_crypt_hdr_inside(BDRVExtreeState *s, const char *what,
                                size_t offset, size_t buflen, Error **errp)
{
    if (offset > s->crypt_hdr_len || buflen > s->crypt_hdr_len - offset) {
        error_setg(errp, "extree: LUKS header %s at %zu+%zu is past the "
                   "end of the encryption header (%" PRIu64 " bytes)",
                   what, offset, buflen, s->crypt_hdr_len);
        return false;
    }
    return true;
}

static int GRAPH_RDLOCK
xt_crypt_hdr_read(QCryptoBlock *block, size_t offset, uint8_t *buf,
                  size_t buflen, void *opaque, Error **errp)
{
    BDRVExtreeState *s = opaque;
    int ret;

    if (!xt_crypt_hdr_inside(s, "read", offset, buflen, errp)) {
        return -1;
    }
    ret = bdrv_pread(s->bs->file, s->crypt_hdr_offset + offset, buflen, buf,
                     0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not read encryption header");
        return -1;
    }
    return 0;
}

static int coroutine_mixed_fn GRAPH_RDLOCK
xt_crypt_hdr_write(QCryptoBlock *block, size_t offset, const uint8_t *buf,
                   size_t buflen, void *opaque, Error **errp)
{
    BDRVExtreeState *s = opaque;
    int ret;

    if (!xt_crypt_hdr_inside(s, "write", offset, buflen, errp)) {
        return -1;
    }
    ret = bdrv_pwrite(s->bs->file, s->crypt_hdr_offset + offset, buflen, buf,
                      0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write encryption header");
        return -1;
    }
    return 0;
}

/* LUKS1's header layout (docs/interop/luks.rst): the fields read here */
#define XT_LUKS_KEY_BYTES       108     /* be32: master key length */
#define XT_LUKS_SLOTS           208     /* 8 key slots of 48 bytes */
#define XT_LUKS_SLOT_SIZE       48
#define XT_LUKS_SLOT_OFFSET     40      /* be32: key material sector */
#define XT_LUKS_SLOT_STRIPES    44      /* be32 */
#define XT_LUKS_NUM_SLOTS       8
#define XT_LUKS_HDR_SECTORS     8       /* key material aligned to 4 KiB */

/*
 * The bytes the LUKS header at the start of the encryption header area
 * occupies: up to the end of its last key slot's material, as LUKS lays
 * it out (qcrypto_block_luks_splitkeylen_sectors()).  Called once
 * qcrypto_block_open() has validated the slots.  crypt_header_length must
 * cover it: a shorter one would let a repair free the other slots.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_crypt_luks_end(BDRVExtreeState *s, uint64_t *end)
{
    uint8_t hdr[XT_LUKS_SLOTS + XT_LUKS_NUM_SLOTS * XT_LUKS_SLOT_SIZE];
    uint64_t key_bytes;
    int ret;

    ret = bdrv_co_pread(s->bs->file, s->crypt_hdr_offset, sizeof(hdr), hdr,
                        0);
    if (ret < 0) {
        return ret;
    }
    key_bytes = ldl_be_p(hdr + XT_LUKS_KEY_BYTES);
    *end = 0;
    for (int i = 0; i < XT_LUKS_NUM_SLOTS; i++) {
        const uint8_t *sl = hdr + XT_LUKS_SLOTS + i * XT_LUKS_SLOT_SIZE;
        uint64_t start = ldl_be_p(sl + XT_LUKS_SLOT_OFFSET);
        uint64_t len = DIV_ROUND_UP(key_bytes *
                                    ldl_be_p(sl + XT_LUKS_SLOT_STRIPES),
                                    BDRV_SECTOR_SIZE);

        len = ROUND_UP(len, XT_LUKS_HDR_SECTORS);
        *end = MAX(*end, (start + len) * BDRV_SECTOR_SIZE);
    }
    return 0;
}

/*
 * @encryptopts: the "encrypt." options of the open, prefix removed.  An
 * image without encryption accepts only options that name no format
 * (like qcow2, which ignores a stray key-secret).
 */
int coroutine_fn GRAPH_RDLOCK
xt_crypt_open(BDRVExtreeState *s, QDict *encryptopts, int flags,
              Error **errp)
{
    BlockDriverState *bs = s->bs;
    const char *fmt = qdict_get_try_str(encryptopts, "format");
    g_autoptr(QCryptoBlockOpenOptions) opts = NULL;
    unsigned cflags = 0;

    if (!extree_crypt_method(s->t)) {
        if (fmt) {
            error_setg(errp, "No encryption in image header, but options "
                       "specified format '%s'", fmt);
            return -EINVAL;
        }
        return 0;
    }
    if (extree_crypt_method(s->t) != EXTREE_CRYPT_LUKS) {
        /* the core refuses unknown methods: a guard */
        error_setg(errp, "extree: unsupported encryption method %" PRIu32,
                   extree_crypt_method(s->t));
        return -ENOTSUP;
    }
    if (fmt && !g_str_equal(fmt, "luks")) {
        error_setg(errp, "Header reported 'luks' encryption format but "
                   "options specify '%s'", fmt);
        return -EINVAL;
    }
    qdict_put_str(encryptopts, "format", "luks");
    opts = block_crypto_open_opts_init(encryptopts, errp);
    if (!opts) {
        return -EINVAL;
    }
    s->crypt_hdr_offset = extree_crypt_header_offset(s->t);
    s->crypt_hdr_len = extree_crypt_header_length(s->t);
    if (flags & BDRV_O_NO_IO) {
        cflags |= QCRYPTO_BLOCK_OPEN_NO_IO;
    }
    /* The LUKS payload offset means nothing here: data is in extents */
    cflags |= QCRYPTO_BLOCK_OPEN_DETACHED;
    s->crypto = qcrypto_block_open(opts, "encrypt.", xt_crypt_hdr_read, s,
                                   cflags, errp);
    if (!s->crypto) {
        return -EINVAL;
    }
    if (!(flags & BDRV_O_NO_IO)) {
        uint64_t end;
        int ret = xt_crypt_luks_end(s, &end);

        if (ret == 0 && end > s->crypt_hdr_len) {
            error_setg(errp, "extree: corrupt superblock: crypt_header_length"
                       " 0x%" PRIx64 " is shorter than the LUKS header it "
                       "holds (0x%" PRIx64 " bytes)", s->crypt_hdr_len, end);
            ret = -EIO;
        } else if (ret < 0) {
            error_setg_errno(errp, -ret, "Could not read encryption header");
        }
        if (ret < 0) {
            qcrypto_block_free(s->crypto);
            s->crypto = NULL;
            return ret;
        }
    }
    bs->encrypted = true;
    trace_extree_crypt_open(s, s->crypt_hdr_offset, s->crypt_hdr_len,
                            !!(flags & BDRV_O_NO_IO));
    return 0;
}

void xt_crypt_close(BDRVExtreeState *s)
{
    qcrypto_block_free(s->crypto);
    s->crypto = NULL;
}

/* ---- Create ---- */

typedef struct XtCryptCreate {
    BlockBackend *blk;
    uint64_t len;                       /* header bytes, 512-aligned */
} XtCryptCreate;

static int coroutine_fn
xt_crypt_create_init(QCryptoBlock *block, size_t headerlen, void *opaque,
                     Error **errp)
{
    XtCryptCreate *c = opaque;
    int ret;

    c->len = ROUND_UP(headerlen, BDRV_SECTOR_SIZE);
    if (c->len > EXTREE_CRYPT_HEADER_MAX) {
        error_setg(errp, "The LUKS header needs %zu bytes; extree allows at "
                   "most %" PRIu64, headerlen,
                   (uint64_t)EXTREE_CRYPT_HEADER_MAX);
        return -1;
    }
    /*
     * Key slots left unused must read as zeroes whatever the storage held
     * before (a block device keeps its old contents)
     */
    ret = blk_co_pwrite_zeroes(c->blk, EXTREE_SB_AREA, c->len, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not zero fill encryption header");
        return -1;
    }
    return 0;
}

static int coroutine_fn
xt_crypt_create_write(QCryptoBlock *block, size_t offset, const uint8_t *buf,
                      size_t buflen, void *opaque, Error **errp)
{
    XtCryptCreate *c = opaque;
    int ret;

    if (offset > c->len || buflen > c->len - offset) {
        error_setg(errp, "extree: LUKS header write past its end");
        return -1;
    }
    ret = blk_co_pwrite(c->blk, EXTREE_SB_AREA + offset, buflen, buf, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "Could not write encryption header");
        return -1;
    }
    return 0;
}

/*
 * Write a new LUKS header at EXTREE_SB_AREA of @blk (before the
 * superblocks are written: an image is never valid without its header);
 * *@header_len: its length for ExtreeCreateParams
 */
int coroutine_fn
xt_crypt_create(BlockBackend *blk, QCryptoBlockCreateOptions *opts,
                uint64_t *header_len, Error **errp)
{
    XtCryptCreate c = { .blk = blk };
    QCryptoBlock *crypto;

    if (opts->format != QCRYPTO_BLOCK_FORMAT_LUKS) {
        error_setg(errp, "Unsupported encryption format '%s' (extree "
                   "supports 'luks')",
                   QCryptoBlockFormat_str(opts->format));
        return -EINVAL;
    }
    crypto = qcrypto_block_create(opts, "encrypt.", xt_crypt_create_init,
                                  xt_crypt_create_write, &c, 0, errp);
    if (!crypto) {
        return -EINVAL;
    }
    qcrypto_block_free(crypto);
    *header_len = c.len;
    return 0;
}

/* Bytes an encrypted image needs for its header, for qemu-img measure */
int xt_crypt_measure(QCryptoBlockCreateOptions *opts, uint64_t *header_len,
                     Error **errp)
{
    size_t len;

    if (opts->format != QCRYPTO_BLOCK_FORMAT_LUKS) {
        error_setg(errp, "Unsupported encryption format '%s' (extree "
                   "supports 'luks')",
                   QCryptoBlockFormat_str(opts->format));
        return -EINVAL;
    }
    if (!qcrypto_block_calculate_payload_offset(opts, "encrypt.", &len,
                                                errp)) {
        return -EINVAL;
    }
    *header_len = ROUND_UP(len, BDRV_SECTOR_SIZE);
    return 0;
}

/* ---- Key slots (qemu-img amend, x-blockdev-amend) ---- */

int GRAPH_RDLOCK
xt_crypt_amend(BDRVExtreeState *s, QCryptoBlockAmendOptions *opts,
               bool force, Error **errp)
{
    if (!s->crypto) {
        error_setg(errp, "image is not encrypted, can't amend");
        return -EOPNOTSUPP;
    }
    if (opts->format != QCRYPTO_BLOCK_FORMAT_LUKS) {
        error_setg(errp, "Amend can't be used to change the extree "
                   "encryption format");
        return -EOPNOTSUPP;
    }
    if (s->core_read_only || s->inactive) {
        error_setg(errp, "extree: the image is read-only");
        return -EACCES;
    }
    return qcrypto_block_amend_options(s->crypto, xt_crypt_hdr_read,
                                       xt_crypt_hdr_write, s, opts, force,
                                       errp);
}

/* ---- Data ---- */

typedef struct XtCryptTask {
    QCryptoBlock *block;
    uint64_t offset;
    uint8_t *buf;
    size_t len;
    bool encrypt;
} XtCryptTask;

static int xt_crypt_pool_fn(void *opaque)
{
    XtCryptTask *t = opaque;

    return t->encrypt ?
        qcrypto_block_encrypt(t->block, t->offset, t->buf, t->len, NULL) :
        qcrypto_block_decrypt(t->block, t->offset, t->buf, t->len, NULL);
}

/*
 * En- or decrypt @buf in place: guest bytes [@guest, @guest + @len), both
 * sector-aligned.  Up to XT_CRYPT_INLINE bytes in the coroutine: AES-XTS
 * does 4 KiB in a few microseconds, less than a trip through the thread
 * pool and back costs; larger buffers in the thread pool, off the
 * AioContext.
 */
int coroutine_fn xt_crypt(BDRVExtreeState *s, bool encrypt, uint64_t guest,
                          void *buf, size_t len)
{
    XtCryptTask t = {
        .block = s->crypto,
        .offset = guest,
        .buf = buf,
        .len = len,
        .encrypt = encrypt,
    };

    assert(s->crypto);
    assert(QEMU_IS_ALIGNED(guest | len, BDRV_SECTOR_SIZE));
    if (!len) {
        return 0;
    }
    if (len <= XT_CRYPT_INLINE) {
        return xt_crypt_pool_fn(&t) < 0 ? -EIO : 0;
    }
    return thread_pool_submit_co(xt_crypt_pool_fn, &t) < 0 ? -EIO : 0;
}

/*
 * One piece of an encrypted read or write: at most XT_CRYPT_PIECE bytes,
 * through a bounce buffer, so the guest's buffer never holds ciphertext.
 * @qiov NULL (writes): zeroes.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_crypt_piece(BDRVExtreeState *s, bool write, uint64_t host, uint64_t guest,
               uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset)
{
    uint8_t *buf = qemu_try_blockalign(s->bs->file->bs, bytes);
    int ret;

    if (!buf) {
        return -ENOMEM;
    }
    if (write) {
        if (qiov) {
            qemu_iovec_to_buf(qiov, qiov_offset, buf, bytes);
        } else {
            memset(buf, 0, bytes);
        }
        ret = xt_crypt(s, true, guest, buf, bytes);
        if (ret == 0) {
            ret = bdrv_co_pwrite(s->bs->file, host, bytes, buf, 0);
        }
    } else {
        ret = bdrv_co_pread(s->bs->file, host, bytes, buf, 0);
        if (ret == 0) {
            ret = xt_crypt(s, false, guest, buf, bytes);
        }
        if (ret == 0) {
            qemu_iovec_from_buf(qiov, qiov_offset, buf, bytes);
        }
    }
    qemu_vfree(buf);
    return ret;
}

typedef struct XtCryptRw {
    BDRVExtreeState *s;
    bool write;
    uint64_t host, guest;
    QEMUIOVector *qiov;
    size_t qiov_offset;
} XtCryptRw;

static int coroutine_fn GRAPH_RDLOCK
xt_crypt_rw_piece(void *opaque, uint64_t offset, uint64_t bytes)
{
    XtCryptRw *rw = opaque;

    return xt_crypt_piece(rw->s, rw->write, rw->host + offset,
                          rw->guest + offset, bytes, rw->qiov,
                          rw->qiov_offset + offset);
}

/*
 * Guest [@guest, + @bytes) at host @host, decrypted into (@write: from)
 * @qiov at @qiov_offset.  A large request goes in pieces of XT_CRYPT_PIECE
 * bytes, XT_CRYPT_WORKERS at a time, as qcow2's do: one piece's I/O
 * overlaps another's cipher, and both cores run ciphers.
 */
static int coroutine_fn GRAPH_RDLOCK
xt_crypt_rw(BDRVExtreeState *s, bool write, uint64_t host, uint64_t guest,
            uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset)
{
    XtCryptRw rw = {
        .s = s, .write = write, .host = host, .guest = guest, .qiov = qiov,
        .qiov_offset = qiov_offset,
    };

    return xt_run_pieces(bytes, XT_CRYPT_PIECE, XT_CRYPT_WORKERS,
                         xt_crypt_rw_piece, &rw);
}

/* Read host [@host, + @bytes), which holds guest [@guest, + @bytes) */
int coroutine_fn GRAPH_RDLOCK
xt_crypt_read(BDRVExtreeState *s, uint64_t host, uint64_t guest,
              uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset)
{
    return xt_crypt_rw(s, false, host, guest, bytes, qiov, qiov_offset);
}

/* The other way round: @qiov's plaintext (NULL: zeroes) to host @host */
int coroutine_fn GRAPH_RDLOCK
xt_crypt_write(BDRVExtreeState *s, uint64_t host, uint64_t guest,
               uint64_t bytes, QEMUIOVector *qiov, size_t qiov_offset)
{
    return xt_crypt_rw(s, true, host, guest, bytes, qiov, qiov_offset);
}
