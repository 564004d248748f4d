"""What belongs to a run on its storage, below the execution layer (trainlab.train
imports this package; it imports neither trainlab.train nor torch nor Ray):

    location   where a run lives (RunLocation: its home, a directory or a store
               prefix, and this node's working copy), the local runs root, log shipping
    dir        a run's directory and naming: new / latest / --run-dir, its config
    lock       one writer per run: the driver's lock (lease) and its takeovers
    holder     the lock's record (.lock.json): who holds the run; the workers
               stop when their driver is gone (`orphaned`)
    records    the run's records: attempts, failures, progress, extensions,
               interrupts, growth requests, run_summary.json (RunRecords)
    checkpoints
               a run's checkpoints as their readers see them (no torch): names,
               records, validation, the catalog (a directory's or a store's:
               catalog(loc)) and retention; writing them is trainlab.train.checkpoint

A summary's content is built from a job in trainlab.train.summaries.
"""
