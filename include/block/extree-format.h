/*
 * extree on-disk format: structures, constants and feature bits
 *
 * docs/interop/extree.rst is the normative description; this header mirrors
 * it.  Every multi-byte field is little-endian.  These are disk types only:
 * never use them as in-memory state, convert with the helpers in
 * block/extree/extree-node.c.
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 *   host file
 *   +----------------+----------------+-----------+------------------------+
 *   | superblock     | superblock     | encryp-   | tree nodes, data blocks|
 *   | slot 0 (4 KiB) | slot 1 (4 KiB) | tion      | and free space, in any |
 *   | at 0           | at 4096        | header    | order, from data_start |
 *   |                |                | (if any)  | up to host_end         |
 *   +----------------+----------------+-----------+------------------------+
 *
 *   data_start = ROUND_UP(8192 + crypt_header_length, block_size)
 *   (crypt_header_length is 0 without the encryption bit)
 *
 *   superblock --extent_root--> extent tree (guest offset -> host extent)
 *              --free_root----> free-space tree (host offset -> free run)
 */

#ifndef BLOCK_EXTREE_FORMAT_H
#define BLOCK_EXTREE_FORMAT_H

#include <stdint.h>

/* "EXTREE\r\n" read as a little-endian 64-bit number */
#define EXTREE_MAGIC            0x0a0d454552545845ULL
#define EXTREE_VERSION          2

#define EXTREE_SB_SIZE          4096
#define EXTREE_SB_SLOTS         2
#define EXTREE_SB_AREA          (EXTREE_SB_SIZE * EXTREE_SB_SLOTS)

/* Allocation granularity: power of two in [512, 2 MiB] */
#define EXTREE_MIN_BLOCK_SIZE   512
#define EXTREE_MAX_BLOCK_SIZE   (2 * 1024 * 1024)
#define EXTREE_DEFAULT_BLOCK_SIZE 4096

/* Tree node size: power of two in [4 KiB, 1 MiB], at least block_size */
#define EXTREE_MIN_NODE_SIZE    4096
#define EXTREE_MAX_NODE_SIZE    (1024 * 1024)
#define EXTREE_DEFAULT_NODE_SIZE 16384

/* Levels are numbered from 0 (leaf); a tree has at most this many */
#define EXTREE_MAX_LEVELS       8

/* Largest virtual size: 2^63 - 1 rounded down to the largest block */
#define EXTREE_MAX_VIRTUAL_SIZE \
    (INT64_MAX & ~(uint64_t)(EXTREE_MAX_BLOCK_SIZE - 1))

/*
 * Largest generation: far beyond any real count of commits (2^62 at a
 * million a second lasts 146,000 years), so that a damaged superblock
 * cannot make the next generation wrap
 */
#define EXTREE_MAX_GENERATION   ((uint64_t)1 << 62)

#define EXTREE_BACKING_FILE_MAX 1023
#define EXTREE_BACKING_FMT_MAX  31

/*
 * Incompatible features: an implementation must refuse to open an image
 * with a bit it does not know.  EXTREE_INCOMPAT_CORRUPT (metadata found
 * damaged) allows read-only access only.
 */
#define EXTREE_INCOMPAT_CORRUPT_BITNR   0
#define EXTREE_INCOMPAT_CORRUPT         (1ULL << EXTREE_INCOMPAT_CORRUPT_BITNR)
/*
 * EXTREE_INCOMPAT_SNAPSHOTS: blocks may be shared (reference count tree),
 * snapshot table, VM state area
 */
#define EXTREE_INCOMPAT_SNAPSHOTS_BITNR 1
#define EXTREE_INCOMPAT_SNAPSHOTS \
    (1ULL << EXTREE_INCOMPAT_SNAPSHOTS_BITNR)
/*
 * EXTREE_INCOMPAT_ENCRYPTED: guest data is encrypted (crypt_method); a
 * reader that does not know the bit would hand out ciphertext
 */
#define EXTREE_INCOMPAT_ENCRYPTED_BITNR 2
#define EXTREE_INCOMPAT_ENCRYPTED \
    (1ULL << EXTREE_INCOMPAT_ENCRYPTED_BITNR)
/*
 * EXTREE_INCOMPAT_COMPRESSED: the extent trees may hold COMPRESSED items;
 * a reader that does not know them would not find the guest data
 */
#define EXTREE_INCOMPAT_COMPRESSED_BITNR 3
#define EXTREE_INCOMPAT_COMPRESSED \
    (1ULL << EXTREE_INCOMPAT_COMPRESSED_BITNR)
/*
 * EXTREE_INCOMPAT_BITMAPS: persistent dirty bitmaps (bitmap directory); a
 * writer that does not know them would change data without marking it,
 * and would not know the bitmaps' blocks are in use
 */
#define EXTREE_INCOMPAT_BITMAPS_BITNR   4
#define EXTREE_INCOMPAT_BITMAPS \
    (1ULL << EXTREE_INCOMPAT_BITMAPS_BITNR)
/*
 * EXTREE_INCOMPAT_MARK_LOG: a mark log (mark_log_offset): bitmap marks of
 * writes in place made durable by an append instead of a commit; a reader
 * that does not replay it would see bitmaps missing those writes, and a
 * writer would not know the log's blocks are in use
 */
#define EXTREE_INCOMPAT_MARK_LOG_BITNR  5
#define EXTREE_INCOMPAT_MARK_LOG \
    (1ULL << EXTREE_INCOMPAT_MARK_LOG_BITNR)
/*
 * EXTREE_INCOMPAT_MAP_LOG (only with the mark log bit): the mark log may
 * hold map records, mapping changes of writes to new space made durable by
 * an append instead of a commit; a reader that does not replay them would
 * see old data where a flushed write went, and a writer would hand their
 * blocks out again
 */
#define EXTREE_INCOMPAT_MAP_LOG_BITNR   6
#define EXTREE_INCOMPAT_MAP_LOG \
    (1ULL << EXTREE_INCOMPAT_MAP_LOG_BITNR)
/*
 * EXTREE_INCOMPAT_LOG_LAG (only with the map log bit): log_lag is not zero,
 * the chain to replay is older than the superblock (marking an image
 * corrupt writes a new superblock but commits nothing); a reader that took
 * the chain of generation + 1 would lose the writes only the chain holds
 */
#define EXTREE_INCOMPAT_LOG_LAG_BITNR   7
#define EXTREE_INCOMPAT_LOG_LAG \
    (1ULL << EXTREE_INCOMPAT_LOG_LAG_BITNR)
#define EXTREE_INCOMPAT_MASK \
    (EXTREE_INCOMPAT_CORRUPT | EXTREE_INCOMPAT_SNAPSHOTS | \
     EXTREE_INCOMPAT_ENCRYPTED | EXTREE_INCOMPAT_COMPRESSED | \
     EXTREE_INCOMPAT_BITMAPS | EXTREE_INCOMPAT_MARK_LOG | \
     EXTREE_INCOMPAT_MAP_LOG | EXTREE_INCOMPAT_LOG_LAG)

/* Compatible features: none defined; unknown bits are ignored */
#define EXTREE_COMPAT_MASK              0ULL
/*
 * Autoclear features: unknown bits are cleared on write.
 * EXTREE_AUTOCLEAR_EXTENT_BYTES: extent_bytes is valid (a writer that
 * does not know it clears the bit, so a stale value is never checked).
 */
#define EXTREE_AUTOCLEAR_EXTENT_BYTES_BITNR 0
#define EXTREE_AUTOCLEAR_EXTENT_BYTES \
    (1ULL << EXTREE_AUTOCLEAR_EXTENT_BYTES_BITNR)
#define EXTREE_AUTOCLEAR_MASK           EXTREE_AUTOCLEAR_EXTENT_BYTES

/* Tree identifiers, stored in every node's owner field */
#define EXTREE_TREE_EXTENT      1
#define EXTREE_TREE_FREE        2
#define EXTREE_TREE_REFS        3       /* reference counts of 2 and more */

/* Snapshots bit: the VM state area of an extent tree, [2^62, 2^63 - 2^21) */
#define EXTREE_VMSTATE_BASE     ((uint64_t)1 << 62)
#define EXTREE_VMSTATE_END      ((uint64_t)INT64_MAX - \
                                 (EXTREE_MAX_BLOCK_SIZE - 1))
#define EXTREE_VMSTATE_MAX      (EXTREE_VMSTATE_END - EXTREE_VMSTATE_BASE)
/* ... so the virtual size stays below it */
#define EXTREE_SNAP_MAX_VIRTUAL_SIZE EXTREE_VMSTATE_BASE
#define EXTREE_MAX_SNAPSHOTS    65535
#define EXTREE_SNAP_ID_MAX      127
#define EXTREE_SNAP_NAME_MAX    255

/*
 * Encryption bit: crypt_method, and the encryption header at
 * [EXTREE_CRYPT_HEADER_OFFSET, + crypt_header_length), right after the
 * superblock slots and below data_start
 */
#define EXTREE_CRYPT_NONE       0
#define EXTREE_CRYPT_LUKS       1       /* QEMU's LUKS (version 1) */
#define EXTREE_CRYPT_HEADER_OFFSET EXTREE_SB_AREA
#define EXTREE_CRYPT_HEADER_ALIGN 512
#define EXTREE_CRYPT_HEADER_MAX (64 * 1024 * 1024)

typedef struct __attribute__((packed)) ExtreeDiskRoot {
    uint64_t bytenr;            /* host offset of the root node */
    uint64_t generation;        /* generation stored in that node */
    uint8_t level;              /* level stored in that node */
    uint8_t reserved[7];
} ExtreeDiskRoot;

typedef struct __attribute__((packed)) ExtreeDiskSuper {
    uint64_t magic;             /*    0: EXTREE_MAGIC */
    uint32_t version;           /*    8: EXTREE_VERSION */
    uint32_t sb_size;           /*   12: EXTREE_SB_SIZE */
    uint32_t csum;              /*   16: crc32c of the slot, this field 0 */
    uint32_t reserved0;         /*   20 */
    uint64_t generation;        /*   24: transaction that wrote this slot */
    uint64_t incompat_features; /*   32 */
    uint64_t compat_features;   /*   40 */
    uint64_t autoclear_features;/*   48 */
    uint64_t virtual_size;      /*   56: bytes, multiple of 512 */
    uint32_t block_size;        /*   64 */
    uint32_t node_size;         /*   68 */
    uint64_t host_end;          /*   72: every used or free block lies below */
    ExtreeDiskRoot extent_root; /*   80 */
    ExtreeDiskRoot free_root;   /*  104 */
    uint64_t extent_count;      /*  128: items in the extent tree */
    uint64_t free_bytes;        /*  136: sum of free-space tree lengths */
    uint16_t backing_file_len;  /*  144 */
    uint16_t backing_fmt_len;   /*  146 */
    uint32_t reserved1;         /*  148 */
    uint64_t extent_bytes;      /*  152: sum of extent tree item lengths */
    ExtreeDiskRoot ref_root;    /*  160: snapshots bit: reference counts */
    uint64_t snap_table_offset; /*  184 */
    uint32_t snap_count;        /*  192 */
    uint32_t reserved5;         /*  196 */
    uint64_t snap_generation;   /*  200: nodes this new or newer: 1 ref */
    uint32_t crypt_method;      /*  208: encryption bit: EXTREE_CRYPT_* */
    uint32_t reserved6;         /*  212 */
    uint64_t crypt_header_offset; /* 216: encryption bit: 8192 */
    uint64_t crypt_header_length; /* 224: encryption bit: bytes */
    uint32_t compression_type;  /*  232: EXTREE_COMPRESS_* new ones use */
    uint32_t reserved7;         /*  236 */
    uint64_t bitmap_dir_offset; /*  240: bitmaps bit: the directory */
    uint32_t bitmap_dir_length; /*  248: bytes of it in use */
    uint32_t bitmap_count;      /*  252 */
    uint64_t mark_log_offset;   /*  256: mark log bit: the log's blocks */
    uint32_t mark_log_length;   /*  264: bytes */
    uint32_t log_lag;           /*  268: log lag bit: chain's age */
    uint8_t reserved2[1024 - 272];
    char backing_fmt[32];       /* 1024 */
    uint8_t reserved3[2048 - 1056];
    char backing_file[1024];    /* 2048 */
    uint8_t reserved4[EXTREE_SB_SIZE - 3072];
} ExtreeDiskSuper;

/*
 * A mark log record: one EXTREE_MARK_LOG_RECORD bytes at mark_log_offset +
 * seq * EXTREE_MARK_LOG_RECORD, its guest ranges right after the header
 */
#define EXTREE_MARK_LOG_MAGIC   0x474f4c4b52414d58ULL   /* "XMARKLOG" */
#define EXTREE_MARK_LOG_RECORD  4096
#define EXTREE_MARK_LOG_MIN     (64 * 1024)
#define EXTREE_MARK_LOG_MAX     (64 * 1024 * 1024)

typedef struct __attribute__((packed)) ExtreeDiskMarkLogHeader {
    uint64_t magic;             /*  0: EXTREE_MARK_LOG_MAGIC */
    uint64_t generation;        /*  8: the transaction it belongs to */
    uint32_t seq;               /* 16: its place in the chain */
    uint32_t count;             /* 20: ranges that follow */
    uint32_t csum;              /* 24: crc32c of the record, this field 0 */
    uint32_t kind;              /* 28: EXTREE_LOG_* (0 without the map bit) */
} ExtreeDiskMarkLogHeader;

#define EXTREE_LOG_MARKS        0       /* ExtreeDiskMarkLogRange follow */
#define EXTREE_LOG_MAPS         1       /* ExtreeDiskMapLogEntry follow */

typedef struct __attribute__((packed)) ExtreeDiskMarkLogRange {
    uint64_t start;             /* guest offset */
    uint64_t length;            /* bytes, > 0 */
} ExtreeDiskMarkLogRange;

#define EXTREE_MARK_LOG_RANGES \
    ((EXTREE_MARK_LOG_RECORD - sizeof(ExtreeDiskMarkLogHeader)) / \
     sizeof(ExtreeDiskMarkLogRange))

/*
 * A map record's entry: guest [guest, + length) now reads from host
 * [host, + length), whose bytes have CRC-32C @csum (map bit)
 */
typedef struct __attribute__((packed)) ExtreeDiskMapLogEntry {
    uint64_t guest;             /*  0: multiple of block_size */
    uint64_t host;              /*  8: multiple of block_size */
    uint64_t length;            /* 16: multiple of block_size, > 0 */
    uint32_t csum;              /* 24: crc32c of the host bytes */
    uint32_t reserved;          /* 28: 0 */
} ExtreeDiskMapLogEntry;

#define EXTREE_MAP_LOG_MAX_ENTRY (64 * 1024 * 1024)
#define EXTREE_MAP_LOG_ENTRIES \
    ((EXTREE_MARK_LOG_RECORD - sizeof(ExtreeDiskMarkLogHeader)) / \
     sizeof(ExtreeDiskMapLogEntry))

#define EXTREE_NODE_MAGIC       0x444e5458U     /* "XTND" */

typedef struct __attribute__((packed)) ExtreeDiskNodeHeader {
    uint32_t csum;              /*  0: crc32c of bytes 4 .. node_size - 1 */
    uint32_t magic;             /*  4: EXTREE_NODE_MAGIC */
    uint64_t bytenr;            /*  8: host offset this node was written at */
    uint64_t generation;        /* 16: transaction that wrote it */
    uint32_t owner;             /* 24: EXTREE_TREE_* */
    uint8_t level;              /* 28: 0 = leaf */
    uint8_t reserved0[3];       /* 29 */
    uint32_t nritems;           /* 32 */
    uint32_t reserved1;         /* 36 */
    uint64_t reserved2[3];      /* 40 */
} ExtreeDiskNodeHeader;

/*
 * Interior item: the child covers keys from @key up to the next item's key.
 * @child_bytes, the summed lengths of the leaf items under the child, lets
 * a reader see a subtree without holes without reading it.
 */
typedef struct __attribute__((packed)) ExtreeDiskKeyPtr {
    uint64_t key;
    uint64_t child;             /* host offset of the child node */
    uint64_t child_generation;
    uint64_t child_bytes;
} ExtreeDiskKeyPtr;

/* Leaf item types */
#define EXTREE_ITEM_DATA        1   /* guest range stored at host_offset */
#define EXTREE_ITEM_ZERO        2   /* guest range reads as zeroes */
#define EXTREE_ITEM_FREE        3   /* free-space tree: free host range */
/* reference count tree: host_offset is the count (>= 2) of every block */
#define EXTREE_ITEM_REFS        4
/*
 * Compressed bit: the guest range is the uncompressed content of the
 * payload at host_offset; flags hold the payload's length and algorithm
 * (EXTREE_COMPRESSED_*).  Never split: a change to part of it rewrites it.
 */
#define EXTREE_ITEM_COMPRESSED  5

/* Compression algorithms (item flags, superblock compression_type) */
#define EXTREE_COMPRESS_NONE    0       /* compression_type: not chosen */
#define EXTREE_COMPRESS_ZLIB    1       /* a zlib stream (RFC 1950) */
#define EXTREE_COMPRESS_ZSTD    2       /* one zstd frame (RFC 8878) */

/* flags of a COMPRESSED item: payload bytes in 0..23, algorithm in 24..31 */
#define EXTREE_COMPRESSED_LEN_MASK  0x00ffffffU
#define EXTREE_COMPRESSED_ALG_SHIFT 24
/* Largest guest length of a COMPRESSED item: a reader's memory bound */
#define EXTREE_COMPRESSED_MAX   (2 * 1024 * 1024)

/*
 * Leaf item.  Extent tree: key = guest offset.  Free-space tree: key =
 * host_offset = start of a free host range.
 */
typedef struct __attribute__((packed)) ExtreeDiskItem {
    uint64_t key;
    uint64_t length;
    uint64_t host_offset;       /* DATA: host offset; ZERO: 0; FREE: = key */
    uint32_t type;              /* EXTREE_ITEM_* */
    uint32_t flags;             /* COMPRESSED: payload length, alg */
} ExtreeDiskItem;

/* Snapshot table: header, then snap_count entries */
#define EXTREE_SNAP_MAGIC       0x4e535458U     /* "XTSN" */
#define EXTREE_SNAP_ENTRY_SIZE  512

typedef struct __attribute__((packed)) ExtreeDiskSnapHeader {
    uint32_t magic;             /*  0: EXTREE_SNAP_MAGIC */
    uint32_t csum;              /*  4: crc32c of header and entries */
    uint32_t count;             /*  8: = snap_count */
    uint32_t entry_size;        /* 12: EXTREE_SNAP_ENTRY_SIZE */
    uint8_t reserved[48];       /* 16 */
} ExtreeDiskSnapHeader;

typedef struct __attribute__((packed)) ExtreeDiskSnapEntry {
    ExtreeDiskRoot root;        /*   0: the snapshot's extent tree */
    uint64_t generation;        /*  24: committed state it was taken of */
    uint64_t virtual_size;      /*  32 */
    uint64_t extent_count;      /*  40 */
    uint64_t extent_bytes;      /*  48 */
    uint64_t date_sec;          /*  56 */
    uint32_t date_nsec;         /*  64 */
    uint32_t reserved0;         /*  68 */
    uint64_t vm_clock_nsec;     /*  72 */
    uint64_t vm_state_size;     /*  80 */
    uint64_t icount;            /*  88: all ones if none */
    uint16_t id_len;            /*  96 */
    uint16_t name_len;          /*  98 */
    uint8_t reserved1[28];      /* 100 */
    char id[128];               /* 128 */
    char name[256];             /* 256 */
} ExtreeDiskSnapEntry;

/*
 * Bitmaps bit: the bitmap directory, a header and bitmap_count entries of
 * variable length (ExtreeDiskBitmapEntry, the name padded to 8 bytes,
 * then the chunk table: nr_chunks ExtreeDiskBitmapChunk).  A chunk is one
 * block of bits: granule g is bit g % 8 of byte g / 8 of the bitmap.
 */
#define EXTREE_BITMAP_MAGIC     0x4d425458U     /* "XTBM" */
#define EXTREE_MAX_BITMAPS      65535
#define EXTREE_BITMAP_NAME_MAX  1023
#define EXTREE_BITMAP_GRAN_MAX_BITS 31          /* 2 GiB, as qcow2 */
#define EXTREE_BITMAP_DIR_MAX   (64 * 1024 * 1024)
#define EXTREE_BITMAP_ENABLED   1U              /* entry flags */

typedef struct __attribute__((packed)) ExtreeDiskBitmapHeader {
    uint32_t magic;             /*  0: EXTREE_BITMAP_MAGIC */
    uint32_t csum;              /*  4: crc32c of the length bytes, this 0 */
    uint32_t count;             /*  8: = bitmap_count */
    uint32_t length;            /* 12: = bitmap_dir_length */
    uint8_t reserved[48];       /* 16 */
} ExtreeDiskBitmapHeader;

typedef struct __attribute__((packed)) ExtreeDiskBitmapEntry {
    uint16_t name_len;          /*  0: 1 .. EXTREE_BITMAP_NAME_MAX */
    uint8_t granularity_bits;   /*  2: log2(granularity) */
    uint8_t flags;              /*  3: EXTREE_BITMAP_ENABLED */
    uint32_t reserved0;         /*  4 */
    uint64_t dirty_granules;    /*  8: bits set */
    uint32_t nr_chunks;         /* 16 */
    uint32_t reserved1;         /* 20 */
    /* 24: name, zero-padded to a multiple of 8; then the chunk table */
} ExtreeDiskBitmapEntry;

typedef struct __attribute__((packed)) ExtreeDiskBitmapChunk {
    uint64_t offset;            /* host offset of the block, 0: all clear */
    uint32_t csum;              /* crc32c of the block; 0 if offset is 0 */
    uint32_t reserved;
} ExtreeDiskBitmapChunk;

_Static_assert(sizeof(ExtreeDiskBitmapHeader) == 64, "bitmap header");
_Static_assert(sizeof(ExtreeDiskBitmapEntry) == 24, "bitmap entry");
_Static_assert(sizeof(ExtreeDiskBitmapChunk) == 16, "bitmap chunk");

#define EXTREE_NODE_HEADER_SIZE sizeof(ExtreeDiskNodeHeader)
#define EXTREE_LEAF_CAPACITY(node_size) \
    (((node_size) - EXTREE_NODE_HEADER_SIZE) / sizeof(ExtreeDiskItem))
#define EXTREE_INTERIOR_CAPACITY(node_size) \
    (((node_size) - EXTREE_NODE_HEADER_SIZE) / sizeof(ExtreeDiskKeyPtr))

_Static_assert(sizeof(ExtreeDiskRoot) == 24, "ExtreeDiskRoot size");
_Static_assert(sizeof(ExtreeDiskSuper) == EXTREE_SB_SIZE, "superblock size");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, extent_root) == 80, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, free_root) == 104, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, backing_file_len) == 144,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, extent_bytes) == 152, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, backing_fmt) == 1024, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, backing_file) == 2048,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, ref_root) == 160, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, snap_table_offset) == 184,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, snap_count) == 192, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, snap_generation) == 200,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, crypt_method) == 208, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, crypt_header_offset) ==
               216, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, crypt_header_length) ==
               224, "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, compression_type) == 232,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, bitmap_dir_offset) == 240,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, mark_log_offset) == 256,
               "sb");
_Static_assert(__builtin_offsetof(ExtreeDiskSuper, reserved2) == 272, "sb");
_Static_assert(sizeof(ExtreeDiskMarkLogHeader) == 32, "mark log header");
_Static_assert(sizeof(ExtreeDiskMarkLogRange) == 16, "mark log range");
_Static_assert(sizeof(ExtreeDiskSnapHeader) == 64, "snapshot table header");
_Static_assert(sizeof(ExtreeDiskSnapEntry) == EXTREE_SNAP_ENTRY_SIZE,
               "snapshot entry");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, generation) == 24,
               "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, date_nsec) == 64,
               "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, vm_clock_nsec) == 72,
               "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, icount) == 88, "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, id_len) == 96, "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, id) == 128, "snap");
_Static_assert(__builtin_offsetof(ExtreeDiskSnapEntry, name) == 256, "snap");
_Static_assert(sizeof(ExtreeDiskNodeHeader) == 64, "node header size");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, magic) == 4, "node");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, bytenr) == 8, "node");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, generation) == 16,
               "node");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, owner) == 24, "node");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, level) == 28, "node");
_Static_assert(__builtin_offsetof(ExtreeDiskNodeHeader, nritems) == 32,
               "node");
_Static_assert(__builtin_offsetof(ExtreeDiskKeyPtr, child) == 8, "key ptr");
_Static_assert(__builtin_offsetof(ExtreeDiskKeyPtr, child_generation) == 16,
               "key ptr");
_Static_assert(__builtin_offsetof(ExtreeDiskKeyPtr, child_bytes) == 24,
               "key ptr");
_Static_assert(__builtin_offsetof(ExtreeDiskItem, length) == 8, "item");
_Static_assert(__builtin_offsetof(ExtreeDiskItem, host_offset) == 16, "item");
_Static_assert(__builtin_offsetof(ExtreeDiskItem, type) == 24, "item");
_Static_assert(__builtin_offsetof(ExtreeDiskItem, flags) == 28, "item");
_Static_assert(__builtin_offsetof(ExtreeDiskRoot, generation) == 8, "root");
_Static_assert(__builtin_offsetof(ExtreeDiskRoot, level) == 16, "root");
_Static_assert(sizeof(ExtreeDiskKeyPtr) == 32, "interior item size");
_Static_assert(sizeof(ExtreeDiskItem) == 32, "leaf item size");

#endif /* BLOCK_EXTREE_FORMAT_H */
