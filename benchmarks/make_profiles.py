"""Write the declared synthetic acceptance profiles of the scale benchmark (fixed seeds; committed, versioned).

    python benchmarks/make_profiles.py

- dflash_like: mean accepted length 6.8 at B = 16 (reported for Qwen3.5-35B-A3B with a z-lab DFlash drafter on code:
  6.1 on GSM8K, 7.7 on HumanEval);
- low: mean accepted length 2.0 (where vanilla DFlash is known to lose to AR).
The real pair's profile is its held-out traces (tiny_pair_heldout.safetensors, written by acceptance_traces.py).
"""
from pathlib import Path

from hybridspec_hf.selector.profiles import save_profile, synthetic_profile

PROFILES = Path(__file__).resolve().parent / "profiles"
DECLARED = {"dflash_like": 6.8, "low": 2.0}

if __name__ == "__main__":
    for name, tau in DECLARED.items():
        profile = synthetic_profile(name, tau, block_size=16, rows=8192, seed=0)
        save_profile(profile, PROFILES / f"{name}.safetensors", declared_mean_accepted_length=tau, seed=0,
                     rows=8192, generator="hybridspec_hf.selector.profiles.synthetic_profile")
        print(f"{name}: mean accepted length {profile.mean_accepted_length:.3f} (declared {tau})")
