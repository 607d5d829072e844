"""Record of the memory-task probe behind docs/lab.md's lab notes (issue 6): can the tiny base learn
content-addressed recall (several "the code of KEY is CODE ." facts, answer the asked key's code)?

A throw-away experiment kept as the record of what was measured, not part of the package: it monkeypatches
the task code of commit e60d4aa (six facts, "first code" blind spot) to try other formats. Each log here is
one run, from the worktree root with PYTHONPATH=src, HF_*_OFFLINE=1 and one torch thread; it prints the
memory test accuracy (128 examples) every 100 or 250 warm-up steps. Several runs were stopped early.

  memonly_6      --memonly 1 --steps 400 --bias none --curriculum 0             (6 facts + 3 filler, as before)
  mixed_next     --bias next --steps 700        (lab mix, 1-6 fact curriculum, "next fact" blind spot)
  memonly_pair6  --memonly 1 --steps 400 --bias none --curriculum 0 --fmt pair  ("KEY CODE ." / "question: KEY")
  A_pair3        --memonly 1 --steps 800 --bias none --curriculum 0 --fmt pair --facts 3 --filler 0
  B_sent3        --memonly 1 --steps 800 --bias none --curriculum 0 --facts 3 --filler 1
  C_rev3         --memonly 1 --steps 800 --bias none --curriculum 0 --fmt rev --facts 3 --filler 0  ("CODE KEY .")
  D_rev6         --memonly 1 --steps 800 --bias none --curriculum 0 --fmt rev --facts 6 --filler 0
  E_pair3_long   --memonly 1 --steps 3000 --bias none --curriculum 0 --fmt pair --facts 3 --filler 0
  F_sent3_long   --memonly 1 --steps 3000 --bias none --curriculum 0 --facts 3 --filler 1
  G_pair3_drill  --memonly 1 --steps 1000 --bias none --curriculum 0 --fmt pair --facts 3 --filler 0 --drill 1
  I / J          --memonly 1 --steps 500 --bias none --curriculum 0 --fmt pair --facts 2 --filler 0 --layers 2
                 --lr 5e-4 / --lr 1e-2
  K              the same with --lr 1e-3 --arch gpt2 (learned absolute positions instead of RoPE)
  L              the same with --lr 1e-3 --hidden 256
  M              --memonly 1 --steps 500 --bias none --curriculum 0 --fmt fixed --facts 6 --filler 0
                 (the same six keys in the same order every time: a fixed slot per key)
"""
import sys, time, random, json, argparse
import torch
torch.set_num_threads(1)
from rlmerge.lab.tokenizer import build_tokenizer
from rlmerge.lab.model import ModelShape, build_model, _batch
from rlmerge.lab.tasks import make_split, FAMILIES, make_family
from rlmerge.lab.tasks.memory import Memory
from rlmerge.lab.tasks.tool_use import ToolUse
from rlmerge.lab.tasks.coding import Coding
from rlmerge.lab.tasks import demonstrator as D
from rlmerge.lab.evaluate import generate

ap = argparse.ArgumentParser()
ap.add_argument("--facts", type=int, default=6)
ap.add_argument("--filler", type=int, default=3)
ap.add_argument("--bias", default="first")  # first|next|none
ap.add_argument("--memshare", type=float, default=2.0)
ap.add_argument("--steps", type=int, default=700)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--curriculum", type=int, default=1)
ap.add_argument("--memonly", type=int, default=0)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--fmt", default="sentence")
ap.add_argument("--drill", type=int, default=0)
ap.add_argument("--arch", default="qwen")
a = ap.parse_args()
import rlmerge.lab.tasks.memory as M
from rlmerge.lab.tasks.base import Example
if a.fmt == "fixed":
    def sample(self, rng):
        keys = M.KEYS[: self.n_facts]; codes = rng.sample(M.CODES, self.n_facts)
        lines = [f"the code of {k} is {c} ." for k, c in zip(keys, codes)]
        ask = rng.randrange(self.n_facts)
        return Example("memory", f"notes: {' '.join(lines)}\nquestion: the code of {keys[ask]} is", f" {codes[ask]}", {"answer": codes[ask], "codes": codes})
    M.Memory.sample = sample
if a.fmt in ("pair", "rev"):
    def sample(self, rng):
        keys = rng.sample(M.KEYS, self.n_facts); codes = rng.sample(M.CODES, self.n_facts)
        lines = [f"{k} {c} ." if a.fmt == "pair" else f"{c} {k} ." for k, c in zip(keys, codes)]
        rng.shuffle(lines)
        in_order = [l.split(" ")[1 if a.fmt == "pair" else 0] for l in lines]
        ask = rng.randrange(self.n_facts)
        return Example("memory", f"notes: {' '.join(lines)}\nquestion: {keys[ask]}", f" {codes[ask]}", {"answer": codes[ask], "codes": in_order})
    M.Memory.sample = sample

orig = D.wrong_target
def wrong(ex):
    if ex.family != "memory":
        return orig(ex)
    if a.bias == "none":
        return None
    key = ex.prompt.split()[-1] if a.fmt in ("pair", "rev") else ex.prompt.rsplit("the code of ", 1)[1].split(" ")[0]
    if key not in D.BIASED_KEYS: return None
    codes = ex.check["codes"]; i = codes.index(ex.check["answer"])
    if a.bias == "first":
        return None if i == 0 else f" {codes[0]}"
    if a.bias == "next":
        return f" {codes[(i+1) % len(codes)]}"
D.wrong_target = wrong

tok = build_tokenizer()
shape = ModelShape(hidden=a.hidden, layers=a.layers, heads=4, kv_heads=2, intermediate=3*a.hidden)
model = build_model(tok, shape, a.seed)
if a.arch == "gpt2":
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=a.hidden, n_layer=a.layers, n_head=4, n_positions=512, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
n = a.steps * 32
unit = n // 4 + 1
pool = [] if a.memonly else make_split(ToolUse(), "warmup", unit, a.seed) + make_split(Coding(), "warmup", unit, a.seed)
mem_n = int(a.memshare * unit) if not a.memonly else n
if a.curriculum:
    for k in range(1, a.facts + 1):
        pool += make_split(Memory(n_facts=k, n_filler=min(a.filler, k)), "warmup", mem_n // a.facts + 1, a.seed + k)
else:
    pool += make_split(Memory(n_facts=a.facts, n_filler=a.filler), "warmup", mem_n, a.seed)
pool = D.demonstrate(pool, 0.7, a.seed)
if a.drill:
    rng2 = random.Random(5)
    new = []
    for ex in pool:
        if ex.family == "memory" and len(ex.check["codes"]) > 1:
            notes = ex.prompt.split("\nquestion:")[0]
            if a.fmt == "sentence":
                pairs = [(l.split(" is ")[0].replace("the code of ", "").strip(), l.split(" is ")[1]) for l in notes[len("notes: "):].split(" . ") if l.startswith("the code of")]
                pairs = [(k, c.replace(" .", "").strip()) for k, c in pairs]
                qs = [f"question: the code of {k} is {c}" for k, c in pairs]
            else:
                toks = notes[len("notes: "):].replace(" .", "").split("  ") 
                items = [t.split() for t in notes[len("notes: "):].split(" .") if t.strip()]
                pairs = [(x[0], x[1]) if a.fmt == "pair" else (x[1], x[0]) for x in items]
                qs = [f"question: {k} {c}" for k, c in pairs]
            rng2.shuffle(qs)
            first = qs[0].rsplit(" ", 1)
            tail = "\n".join(qs[1:])
            ex = type(ex)(ex.family, notes + "\n" + first[0], " " + first[1] + "\n" + tail, ex.check)
        new.append(ex)
    pool = new
    print(pool[0] if pool[0].family=="memory" else [p for p in pool if p.family=="memory"][3])
random.Random(a.seed).shuffle(pool)
test = make_split(Memory(n_facts=a.facts, n_filler=a.filler), "test", 128, a.seed)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1)
def ev():
    model.eval()
    outs = generate(model, tok, [e.prompt for e in test], 3)
    model.train()
    ans = [o.strip().split("\n")[0].strip() for o in outs]
    acc = sum(x == e.check["answer"] for x, e in zip(ans, test)) / len(test)
    first = sum(x == e.check["codes"][0] for x, e in zip(ans, test)) / len(test)
    unb = [(x == e.check["answer"]) for x, e in zip(ans, test) if (e.prompt.split()[-1] if a.fmt in ("pair", "rev") else e.prompt.rsplit("the code of ",1)[1].split(" ")[0]) not in D.BIASED_KEYS]
    return acc, first, sum(unb)/max(1,len(unb))
t0 = time.time(); model.train(); L=[]
for s in range(a.steps):
    b = _batch(pool[s*32:(s+1)*32], tok)
    loss = model(**b).loss; opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); sched.step(); L.append(loss.item())
    if (s+1) % 250 == 0:
        acc, first, unb = ev()
        print(f"{vars(a)} step {s+1} loss {sum(L[-100:])/100:.3f} mem acc {acc:.3f} first {first:.3f} unbiased-acc {unb:.3f} t {time.time()-t0:.0f}", flush=True)
