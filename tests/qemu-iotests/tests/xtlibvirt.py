# The private libvirtd and the test guest of the libvirt iotests
# (extree-libvirt, extree-virtnbdbackup).
#
# The daemon, built by scripts/build-libvirt.sh (libvirt 11.3 with
# patches/libvirt), is privileged (root) but private: the test starts and
# stops it in a mount namespace where its compiled-in /etc and /var
# directories (under the installed copy's prefix) are the test's own, and
# it listens on a socket in SOCK_DIR.
#
# The guest is the small test guest (tests/guest/init) in kill mode under
# TCG: numbered 64 KiB blocks, each fsynced and reported on the serial
# console.  What the disk must hold: 1024 slots of 64 KiB, block N in slot
# N * 389 mod 1024 filled with one byte value.  The block the guest was
# writing when it was paused may be old or new.
#
# Copyright (c) 2026 The extree authors
#
# SPDX-License-Identifier: GPL-2.0-or-later

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import iotests

TOP = os.path.realpath(os.path.join(os.path.dirname(os.path.realpath(__file__)),
                                    '..', '..', '..'))
INST = os.path.realpath(os.path.join(TOP, 'build', 'libvirt-inst'))
LIBVIRTD = os.path.join(INST, 'sbin', 'libvirtd')
VIRSH = os.path.join(INST, 'bin', 'virsh')


def problems():
    """Why a libvirt iotest cannot run here.  Not run if libvirt is not
    built; anything else missing is a failure, not a reason to skip."""
    if not (os.access(LIBVIRTD, os.X_OK) and os.access(VIRSH, os.X_OK)):
        iotests.notrun('libvirt is not built (scripts/build-libvirt.sh)')
    found = [f'{tool} is not installed' for tool in ('unshare', 'nbdinfo')
             if not shutil.which(tool)]
    if os.geteuid() != 0:
        found.append('the private libvirtd runs as root (in a mount namespace)')
    # libvirt puts QEMU's monitor socket under its compiled-in state
    # directory (the install's prefix), and a UNIX socket path has at most
    # 107 bytes
    if len(INST + '/var/lib/libvirt/qemu/domain-99-probe/monitor.sock') > 107:
        found.append(f'the libvirt install path is too long for QEMU monitor '
                     f'sockets ({INST}): set EXTREE_CACHE to a shorter directory')
    return found


QEMU = os.path.realpath(iotests.qemu_prog)
QEMU_IMG = os.path.realpath(os.environ.get('QEMU_IMG_PROG', 'qemu-img'))
QEMU_IO = os.path.realpath(os.environ.get('QEMU_IO_PROG', 'qemu-io'))
QEMU_BIN = os.path.dirname(QEMU_IMG)
GUEST = os.environ.get('EXTREE_GUEST_DIR', os.path.join(TOP, 'build', 'guest'))

W = os.path.join(iotests.test_dir, 'libvirt')
SOCKS = os.path.join(iotests.sock_dir, f'lv-{os.getpid()}')
URI = f'qemu+unix:///system?socket={SOCKS}/libvirt-sock'
SERIAL = os.path.join(W, 'serial.log')
MiB = 1 << 20
SLOT = 64 * 1024
NSLOTS = 1024
SIZE = NSLOTS * SLOT
LOG = os.path.join(TOP, 'build', 'iotests', 'libvirt.log')
NAME = os.path.basename(sys.argv[0])

T0 = time.time()


class Fail(Exception):
    pass


def note(msg):
    """Machine-dependent detail: to build/iotests/libvirt.log only."""
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, 'a', encoding='utf-8') as f:
        f.write(f'{NAME} +{time.time() - T0:.1f}s: {msg}\n')


def run(*args, check=True, timeout=300, env=None):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       universal_newlines=True, timeout=timeout, env=env,
                       check=False)
    if check and p.returncode != 0:
        raise Fail(f'{" ".join(args)}: exit {p.returncode}: {p.stdout.strip()}')
    return p


def virsh(*args, check=True, timeout=300):
    p = run(VIRSH, '-q', '-c', URI, *args, check=False, timeout=timeout)
    note(f'virsh {" ".join(args)} -> {p.returncode}')
    if check and p.returncode != 0:
        raise Fail(f'virsh {" ".join(args)}: {p.stdout.strip()}')
    return p.stdout


def write(path, text):
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)


# --- the guest's blocks ------------------------------------------------------

def block_slot(n):
    return (n * 389) % NSLOTS


def block_value(n, rnd):
    return 1 + (n * 7 + rnd * 31) % 255


class Expect:
    """What the disk holds: slot -> byte value (0: never written), and the
    one block that may or may not have reached the disk."""

    def __init__(self):
        self.slots = [0] * NSLOTS
        self.maybe = None          # (slot, value) of a block in flight
        self.next = 0              # next block number the guest writes
        self.rnd = 0
        self.offset = 0            # serial log offset read so far

    def copy(self):
        e = Expect()
        e.slots = list(self.slots)
        e.maybe, e.next, e.rnd, e.offset = self.maybe, self.next, self.rnd, self.offset
        return e

    def feed(self):
        """Apply the guest's new 'XT synced N' lines."""
        with open(SERIAL, 'rb') as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b'\n') + 1
        self.offset += end
        for line in data[:end].decode('latin-1').splitlines():
            line = line.strip()
            m = re.match(r'^XT synced (\d+)$', line)
            if m:
                n = int(m.group(1))
                if n != self.next:
                    raise Fail(f'guest reported block {n}, expected {self.next}')
                self.slots[block_slot(n)] = block_value(n, self.rnd)
                self.next = n + 1
            elif line.startswith('XT error'):
                raise Fail(f'guest: {line}')
            elif line.startswith('XT done'):
                raise Fail('the guest finished all its blocks: the test waited too long')
        self.maybe = (block_slot(self.next), block_value(self.next, self.rnd))

    def changed_since(self, other):
        return {i for i in range(NSLOTS) if self.slots[i] != other.slots[i]}


def read_disk(img, fmt='extree', opts=None, objects=()):
    """The disk's content as raw bytes (qemu-img convert, force-share)."""
    raw = os.path.join(W, 'read.raw')
    if os.path.exists(raw):
        os.unlink(raw)
    obj = [a for o in objects for a in ('--object', o)]
    if opts:
        run(QEMU_IMG, 'convert', '-U', *obj, '--image-opts', opts, '-O', 'raw', raw)
    else:
        run(QEMU_IMG, 'convert', '-U', '-f', fmt, '-O', 'raw', img, raw)
    with open(raw, 'rb') as f:
        data = f.read()
    os.unlink(raw)
    return data


def compare(what, data, exp, resolve=False):
    """Check DATA (the disk's bytes) against EXP; with RESOLVE, the block in
    flight becomes what the disk has."""
    if len(data) != SIZE:
        raise Fail(f'{what}: {len(data)} bytes, expected {SIZE}')
    bad = []
    maybe_slot = exp.maybe[0] if exp.maybe else None
    for i in range(NSLOTS):
        chunk = data[i * SLOT:(i + 1) * SLOT]
        ok = [exp.slots[i]]
        if i == maybe_slot:
            ok.append(exp.maybe[1])
        if not any(chunk == bytes([v]) * SLOT for v in ok):
            bad.append(i)
    if bad:
        raise Fail(f'{what}: {len(bad)} slots differ from what the guest wrote '
                   f'(first: slot {bad[0]})')
    if resolve and maybe_slot is not None:
        v = data[maybe_slot * SLOT]
        if v == exp.maybe[1] and v != exp.slots[maybe_slot]:
            # the block reached the disk although not reported: the guest
            # reports it when it runs again
            exp.slots[maybe_slot] = v
    written = sum(1 for v in exp.slots if v)
    iotests.log(f'  {what}: equal to what the guest wrote')
    note(f'{what}: {written} slots written, next block {exp.next}')


# --- the daemon ----------------------------------------------------------------

daemon = None


def start_daemon():
    global daemon
    for d in ('etc/libvirt', 'var/run/libvirt', 'var/lib/libvirt',
              'var/cache/libvirt', 'var/log/libvirt', 'pool'):
        os.makedirs(os.path.join(W, d), exist_ok=True)
    os.makedirs(SOCKS, exist_ok=True)
    write(os.path.join(W, 'etc/libvirt/libvirtd.conf'),
          f'unix_sock_dir = "{SOCKS}"\n'
          'unix_sock_rw_perms = "0700"\n'
          'auth_unix_rw = "none"\n'
          'auth_unix_ro = "none"\n'
          f'log_outputs = "3:file:{W}/libvirtd.log"\n')
    write(os.path.join(W, 'etc/libvirt/qemu.conf'),
          'user = "root"\n'
          'group = "root"\n'
          'dynamic_ownership = 0\n'
          'remember_owner = 0\n'
          'security_driver = "none"\n'
          'namespaces = [ ]\n'
          'cgroup_controllers = [ ]\n'
          'stdio_handler = "file"\n')
    env = dict(os.environ)
    # libvirt runs qemu-img by name (offline snapshots, storage volumes)
    env['PATH'] = QEMU_BIN + ':' + env.get('PATH', '/usr/bin:/bin')
    script = (f'mount --bind "{W}/etc" "{INST}/etc" && '
              f'mount --bind "{W}/var" "{INST}/var" && '
              f'exec "{LIBVIRTD}" -f "{W}/etc/libvirt/libvirtd.conf"')
    with open(os.path.join(W, 'libvirtd.out'), 'w', encoding='utf-8') as out:
        # pylint: disable=consider-using-with
        daemon = subprocess.Popen(['unshare', '-m', '--propagation', 'private',
                                   'sh', '-c', script],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        if daemon.poll() is not None:
            raise Fail(f'libvirtd exited with status {daemon.returncode}: '
                       + open(os.path.join(W, 'libvirtd.out'), encoding='utf-8').read())
        if run(VIRSH, '-c', URI, 'version', check=False, timeout=30).returncode == 0:
            note('libvirtd up')
            return
        time.sleep(0.1)
    raise Fail('libvirtd did not answer within 30 s')


def stop_daemon():
    """Stop every running domain, then the daemon."""
    if daemon is None:
        return
    out = run(VIRSH, '-q', '-c', URI, 'list', '--name', check=False, timeout=60).stdout
    for dom in out.split():
        run(VIRSH, '-c', URI, 'destroy', dom, check=False, timeout=60)
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()



# --- the domain ------------------------------------------------------------------

def domain_xml(name, disk_xml, emulator=QEMU, rnd=1):
    return f'''<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{GUEST}/vmlinux</kernel>
    <initrd>{GUEST}/initrd.img</initrd>
    <cmdline>console=ttyS0 quiet panic=-1 extree.mode=kill extree.disk=vda extree.round={rnd}</cmdline>
  </os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{emulator}</emulator>
    {disk_xml}
    <serial type='file'>
      <source path='{SERIAL}' append='on'/>
      <target port='0'/>
    </serial>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
'''


def disk_xml(path, fmt='extree'):
    return (f"<disk type='file' device='disk'>"
            f"<driver name='qemu' type='{fmt}'/>"
            f"<source file='{path}'/>"
            f"<target dev='vda' bus='virtio'/></disk>")


def define(name, xml):
    path = os.path.join(W, f'{name}.xml')
    write(path, xml)
    virsh('define', path)


def set_round(rnd, dom='xt'):
    """Redefine DOM's kernel command line for the next boot's round."""
    xml = virsh('dumpxml', '--inactive', dom)
    xml = re.sub(r'extree\.round=\d+', f'extree.round={rnd}', xml)
    path = os.path.join(W, f'{dom}.xml')
    write(path, xml)
    virsh('define', path)


def boot(exp, rnd, dom='xt'):
    """Start DOM; the guest begins its blocks again with round RND."""
    set_round(rnd, dom)
    exp.offset = os.path.getsize(SERIAL) if os.path.exists(SERIAL) else 0
    exp.next, exp.rnd = 0, rnd
    virsh('start', dom)


def run_guest(exp, blocks, dom='xt'):
    """Let the guest write BLOCKS more blocks, then pause it."""
    want = exp.next + blocks
    state = virsh('domstate', dom).strip()
    if state == 'paused':
        virsh('resume', dom)
    deadline = time.time() + 300
    while True:
        exp.feed()
        if exp.next >= want:
            break
        if time.time() > deadline:
            raise Fail(f'the guest reached block {exp.next}, not {want}, in 300 s')
        time.sleep(0.05)
    virsh('suspend', dom)
    exp.feed()


def wait_job(dom='xt'):
    deadline = time.time() + 300
    while 'None' not in virsh('domjobinfo', dom):
        if time.time() > deadline:
            raise Fail('block job still running after 300 s')
        time.sleep(0.1)
    info = virsh('domjobinfo', '--completed', dom)
    if 'Completed' not in info:
        raise Fail(f'job did not complete: {info}')


def img_info(path):
    out = run(QEMU_IMG, 'info', '-U', '--output=json', path).stdout
    return json.loads(out)


def build_guest():
    """Build the test guest (scripts/build-guest.sh) if needed; False, with
    the script's output printed, if it cannot be built."""
    p = run(os.path.join(TOP, 'scripts', 'build-guest.sh'), GUEST, check=False, timeout=900)
    if p.returncode != 0:
        iotests.log('cannot build the guest (scripts/build-guest.sh)')
        print(p.stdout)
        return False
    return True


def daemon_log_tail():
    """The last lines of libvirtd's log, to stderr (after a failure)."""
    try:
        with open(os.path.join(W, 'libvirtd.log'), encoding='utf-8') as f:
            tail = f.readlines()[-15:]
        print(''.join(tail), file=sys.stderr)
    except OSError:
        pass
