"""Run scripts/fit.py unchanged, but print every trial (T, batch, fits, seconds) to stderr as it ends,
so a run stopped by a time limit still shows how far each search got."""
import runpy, sys, time
sys.path.insert(0, ".")
import training.fit as tf

_fits = tf.StepTrial.fits
def fits(self, batch):
    t0 = time.time()
    ok = _fits(self, batch)
    print(f"# trial {self.backend if isinstance(self.backend, str) else ''} T={self.cfg.block_size} batch={batch} "
          f"fits={ok} {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return ok
tf.StepTrial.fits = fits
sys.argv = ["scripts/fit.py", *sys.argv[1:]]
runpy.run_path("scripts/fit.py", run_name="__main__")
