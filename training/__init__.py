"""Sluice training: config, launch, trainer, data, optimizer and metrics."""

import threading

from tqdm import tqdm

# tqdm's default lock is a multiprocessing RLock: a named semaphore in /dev/shm per process that draws a bar or
# writes a line, which a SIGKILL of the process group (scancel, an OOM kill) leaves behind. Each Sluice process
# draws from one thread at a time, so a thread lock serves; set once, here, before any bar or tqdm.write.
tqdm.set_lock(threading.RLock())
