"""Advanced lesson 10: prefill/decode disaggregation. The connector's bookkeeping (pure), the
store's round trip bit for bit, the two engines token-equal to the colocated one with the KV
after transfer equal block for block, every fault path (a layer lost, a layer late, a damaged
file, the prefill process killed, the decode process killed) ending in a counted local recompute
or a clear error with every pool's free count back to full and nothing left running."""
from __future__ import annotations

import pytest
import torch

from advanced.adv10_pd_disaggregation.cluster import PDCluster
from advanced.adv10_pd_disaggregation.connector import ConnectorScheduler, TransferParams, prompt_key
from advanced.adv10_pd_disaggregation.engines import build_pd_engine
from advanced.adv10_pd_disaggregation.process import parse_fault
from advanced.adv10_pd_disaggregation.store import KVStore, StoreConnectorWorker, TransferError
from step04_transformer.loader import load_model
from step06_sampler.params import SamplingParams
from step09_continuous_batching.scheduler import ScheduledBatch
from step09_continuous_batching.sequence import Sequence
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.kv_pool import HeadMajorKVPool

BS = 4
CONFIG = PagedSchedulerConfig(block_size=BS, kv_cache_bytes=1 << 20, max_num_batched_tokens=256)
LENGTHS = (5, 17, 33, 8)
WAIT_S = 120.0           # the bound on a multi-process run here (a busy machine starts slowly)


def _prompts(lengths=LENGTHS) -> list[list[int]]:
    return [[(7 * i + j) % 500 + 3 for i in range(n)] for j, n in enumerate(lengths)]


def _params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _seq(n: int, table: list[int] | None = None) -> Sequence:
    seq = Sequence(list(range(3, 3 + n)), _params())
    seq.block_table = table
    return seq


# ---- the connector's scheduler side: bookkeeping only -----------------------------------------
def test_consumer_is_told_every_prompt_token_but_the_last():
    c = ConnectorScheduler(BS)
    seq, plain, prod = _seq(10), _seq(10), _seq(10)
    c.register(seq, TransferParams(7, "k7", "consumer"))
    c.register(prod, TransferParams(8, "k8", "producer"))
    assert c.get_num_new_matched_tokens(seq, 0) == 9
    assert c.get_num_new_matched_tokens(seq, 4) == 5                 # one local block hit
    assert c.get_num_new_matched_tokens(plain, 0) == 0               # not a transfer
    assert c.get_num_new_matched_tokens(prod, 0) == 0                # the producer loads nothing
    with pytest.raises(ValueError, match="role"):
        c.register(_seq(3), TransferParams(9, "k9", "both"))


def test_load_plan_skips_local_hits_and_is_handed_out_once():
    c = ConnectorScheduler(BS)
    seq = _seq(10, [11, 12, 13])
    c.register(seq, TransferParams(7, "k7", "consumer"))
    seq.num_computed_tokens = 4                                      # block 11 was a local hit
    c.update_state_after_alloc(seq, c.get_num_new_matched_tokens(seq, 4))
    meta = c.build_connector_meta()
    assert [(s.req_id, s.key, s.block_ids, s.first_block, s.num_tokens) for s in meta.loads] == \
        [(7, "k7", [12, 13], 1, 5)]
    assert c.build_connector_meta().loads == []                      # once
    assert c.get_num_new_matched_tokens(seq, 0) == 0                 # consumed: a preempted seq recomputes
    assert c.request_finished(seq) is False and 7 not in [p.req_id for p in c.params.values()]
    bad = _seq(10, [1, 2, 3])
    c.register(bad, TransferParams(9, "k9", "consumer"))
    bad.num_computed_tokens = 3
    with pytest.raises(ValueError, match="whole number"):
        c.update_state_after_alloc(bad, 6)
    short = _seq(10, [1])
    c.register(short, TransferParams(10, "k10", "consumer"))
    with pytest.raises(ValueError, match="holds 1 blocks"):
        c.update_state_after_alloc(short, 9)


def test_saves_only_in_the_step_that_completes_the_prompt():
    c = ConnectorScheduler(BS)
    seq = _seq(10, [5, 6, 7])
    c.register(seq, TransferParams(3, "k3", "producer"))
    first, last = ScheduledBatch(), ScheduledBatch()
    first.add(seq, 6)                                                # a first chunk: nothing to ship
    assert c.build_connector_meta(first).saves == []
    seq.num_computed_tokens = 6
    last.add(seq, 4)
    (save,) = c.build_connector_meta(last).saves
    assert (save.req_id, save.key, save.block_ids, save.num_tokens) == (3, "k3", [5, 6, 7], 10)


def test_prompt_key_names_the_request_and_its_tokens():
    assert prompt_key([1, 2, 3], 0) == prompt_key([1, 2, 3], 0)
    assert prompt_key([1, 2, 3], 0) != prompt_key([1, 2, 4], 0) != prompt_key([1, 2, 3], 1)


def test_bad_faults_and_modes_are_refused_before_any_process():
    with pytest.raises(ValueError, match="a comma-separated list"):
        parse_fault("drop")
    with pytest.raises(ValueError, match="distinct"):
        parse_fault("drop:1,drop:2")
    assert parse_fault("drop:1,exit-decode:3") == {"drop": 1, "exit-decode": 3}
    with pytest.raises(ValueError, match="mode must be"):
        PDCluster("nowhere", mode="split")
    with pytest.raises(ValueError, match="a comma-separated list"):
        PDCluster("nowhere", fault="explode:1")
    with pytest.raises(ValueError, match="transport must be"):
        PDCluster("nowhere", transport="pigeon")


# ---- the store ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_round_trip_is_bit_for_bit(tmp_path, dtype):
    store = KVStore(tmp_path)
    k, v = torch.randn(3, 2, BS, 16).to(dtype), torch.randn(3, 2, BS, 16).to(dtype)
    assert store.read_layer("r0-x", 0) is None                       # not landed yet
    assert store.write_layer("r0-x", 0, k, v) == 2 * k.numel() * k.element_size()
    k2, v2 = store.read_layer("r0-x", 0)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)
    assert [p.name for p in (tmp_path / "r0-x").iterdir()] == ["L000.kv"]   # no temporary left
    (tmp_path / "r0-x" / "L001.kv").write_bytes(b"not a tensor file")
    with pytest.raises(TransferError, match="unreadable"):
        store.read_layer("r0-x", 1)
    (tmp_path / "r1-y").mkdir()
    (tmp_path / "r0-x" / "L000.kv").rename(tmp_path / "r1-y" / "L000.kv")
    with pytest.raises(TransferError, match="holds r0-x"):
        store.read_layer("r1-y", 0)
    store.remove("r0-x")
    assert store.keys() == ["r1-y"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KVStore(tmp_path / "missing")


def test_decode_side_takes_layer_0_before_the_last_layer_exists(tmp_path, tiny_qwen3_dir):
    cfg = load_model(tiny_qwen3_dir, torch.float32).config
    src, dst = HeadMajorKVPool(cfg, 8, BS, torch.float32), HeadMajorKVPool(cfg, 8, BS, torch.float32)
    for t in src.k + src.v:
        t.copy_(torch.randn_like(t))
    store = KVStore(tmp_path)
    saver, loader = StoreConnectorWorker(store, src, cfg.num_layers), StoreConnectorWorker(store, dst, cfg.num_layers)
    producer, consumer = ConnectorScheduler(BS), ConnectorScheduler(BS)
    seq_p, seq_c = _seq(10, [1, 2, 3]), _seq(10, [6, 4, 5])
    producer.register(seq_p, TransferParams(0, "r0-k", "producer"))
    consumer.register(seq_c, TransferParams(0, "r0-k", "consumer"))
    batch = ScheduledBatch()
    batch.add(seq_p, 10)
    saver.bind(producer.build_connector_meta(batch))
    consumer.update_state_after_alloc(seq_c, consumer.get_num_new_matched_tokens(seq_c, 0))
    loader.start_load_kv(consumer.build_connector_meta())
    saver.save_kv_layer(0, src)                                      # only layer 0 has landed
    assert loader.wait_for_layer_load(0, 0) and not loader.wait_for_layer_load(0, 1)
    assert torch.equal(dst.k[0][[6, 4, 5]], src.k[0][[1, 2, 3]])
    saver.save_kv_layer(1, src)
    saver.wait_for_save()
    done, failed = loader.progress()
    assert [d.spec.req_id for d in done] == [0] and not failed
    for layer in range(cfg.num_layers):
        assert torch.equal(dst.k[layer][[6, 4, 5]], src.k[layer][[1, 2, 3]])
        assert torch.equal(dst.v[layer][[6, 4, 5]], src.v[layer][[1, 2, 3]])


# ---- the two engines in this process -------------------------------------------------------------
def _engines(folder, tmp_path, timeout_s=10.0, drop=frozenset(), config=CONFIG):
    model = load_model(folder, torch.float32)
    store = KVStore(tmp_path)
    pre = build_pd_engine(model, "prefill", lambda pool, n: StoreConnectorWorker(store, pool, n, timeout_s, set(drop)),
                          config)
    dec = build_pd_engine(model, "decode", lambda pool, n: StoreConnectorWorker(store, pool, n, timeout_s), config)
    return model, store, pre, dec


def _full(engine) -> bool:
    bm = engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks


def _prefill_all(pre, prompts) -> None:
    for rid, p in enumerate(prompts):
        pre.add_prefill(rid, p, prompt_key(p, rid))
    while pre.has_unfinished():
        pre.step()


@pytest.fixture
def colocated_tokens(tiny_qwen3_dir, one_thread):
    col = build_pd_engine(load_model(tiny_qwen3_dir, torch.float32), "colocated", config=CONFIG)
    return [s.output_token_ids for s in col.generate(_prompts(), _params())]


def test_disaggregated_tokens_and_kv_equal_the_colocated_engine(tiny_qwen3_dir, tmp_path, colocated_tokens):
    model, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path)
    col = build_pd_engine(model, "colocated", config=CONFIG)
    prompts = _prompts()
    _prefill_all(pre, prompts)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    refs = [col.add_request(p, _params()) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        dec.step()
    while any(not s.output_token_ids for s in refs):
        col.step()
    for seq, ref in zip(seqs, refs):                                # both hold the prompt's KV now
        n = seq.num_prompt_tokens - 1                                # the transferred positions
        for layer in range(model.config.num_layers):
            for mine, theirs in ((dec.kv_pool.k, col.kv_pool.k), (dec.kv_pool.v, col.kv_pool.v)):
                a = mine[layer][seq.block_table].transpose(1, 2).flatten(0, 1)[:n + 1]
                b = theirs[layer][ref.block_table].transpose(1, 2).flatten(0, 1)[:n + 1]
                assert torch.equal(a[:n], b[:n])                     # bit for bit, block for block
                torch.testing.assert_close(a[n], b[n])               # the last one computed here
    while dec.has_unfinished():
        dec.step()
    assert [s.output_token_ids for s in seqs] == colocated_tokens
    assert dec.prompt_tokens == len(prompts)                         # one prompt token each: no prefill redone
    assert dec.fallbacks == [] and store.keys() == []
    assert _full(pre) and _full(dec)


def test_local_prefix_hit_loads_only_the_rest(tiny_qwen3_dir, tmp_path, one_thread):
    model, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path)
    shared = _prompts((12,))[0]
    prompts = [shared + [40, 41, 42], shared + [50, 51, 52, 53, 54]]
    want = [s.output_token_ids for s in build_pd_engine(model, "colocated", config=CONFIG).generate(prompts, _params())]
    _prefill_all(pre, prompts)
    first = dec.add_consumer(0, prompts[0], _params(), prompt_key(prompts[0], 0))
    while dec.has_unfinished():
        dec.step()
    second = dec.add_consumer(1, prompts[1], _params(), prompt_key(prompts[1], 1))
    dec.advance_transfers()
    assert dec.loads[1].spec.first_block == 3                        # 12 tokens = 3 blocks hit here
    while dec.has_unfinished():
        dec.step()
    assert [first.output_token_ids, second.output_token_ids] == want
    assert _full(pre) and _full(dec) and dec.fallbacks == []


def test_lost_layer_is_a_counted_local_recompute(tiny_qwen3_dir, tmp_path, colocated_tokens):
    _, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path, drop={(1, 1)})     # request 1's last layer
    prompts = _prompts()
    _prefill_all(pre, prompts)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    dec.advance_transfers()
    dec.worker.producer_done(1)                                      # the prefill engine is done with it
    while dec.has_unfinished():
        dec.step()
    assert [(f.req_id, f.tokens_recomputed) for f in dec.fallbacks] == [(1, LENGTHS[1])]
    assert "layer 1 never arrived" in dec.fallbacks[0].reason
    assert [s.output_token_ids for s in seqs] == colocated_tokens
    assert dec.prompt_tokens == len(prompts) - 1 + LENGTHS[1]
    assert _full(pre) and _full(dec) and store.keys() == []


def test_late_layer_times_out_and_damaged_file_fails(tiny_qwen3_dir, tmp_path, colocated_tokens):
    _, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path, timeout_s=0.2, drop={(0, 1)})
    prompts = _prompts()
    _prefill_all(pre, prompts)
    store.layer_path(prompt_key(prompts[2], 2), 0).write_bytes(b"\0" * 100)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    dec.advance_transfers()
    dec.worker.arm(0)                                                # started, then silent
    while dec.has_unfinished():
        dec.step()
    reasons = {f.req_id: f.reason for f in dec.fallbacks}
    assert sorted(reasons) == [0, 2]
    assert "did not arrive within 0.2 s" in reasons[0] and "unreadable" in reasons[2]
    assert [s.output_token_ids for s in seqs] == colocated_tokens
    assert _full(pre) and _full(dec) and store.keys() == []


def test_prefill_lost_before_a_load_opens_is_counted_once(tiny_qwen3_dir, tmp_path, one_thread):
    _, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path)
    p = _prompts()[1]
    seq = dec.add_consumer(0, p, _params(), prompt_key(p, 0))
    dec.fail_transfer(0, "the prefill engine exited")                # still in `arrived`
    dec.fail_transfer(0, "the prefill engine exited")
    while dec.has_unfinished():
        dec.step()
    assert len(dec.fallbacks) == 1 and len(seq.output_token_ids) == 6 and _full(dec)


def test_news_that_overtakes_the_load_is_kept_for_it(tiny_qwen3_dir, tmp_path, colocated_tokens):
    """The launcher's "started"/"prefilled" can reach the decode engine in the same batch of
    messages as the request, before its load opens: they must still arm it, else a lost layer
    would be waited for forever."""
    _, store, pre, dec = _engines(tiny_qwen3_dir, tmp_path, timeout_s=0.2, drop={(1, 1), (2, 1)})
    prompts = _prompts()
    _prefill_all(pre, prompts)
    seqs = [dec.add_consumer(rid, p, _params(), prompt_key(p, rid)) for rid, p in enumerate(prompts)]
    dec.worker.producer_done(1)                                      # both before advance_transfers
    dec.worker.arm(2)
    while dec.has_unfinished():
        dec.step()
    reasons = {f.req_id: f.reason for f in dec.fallbacks}
    assert sorted(reasons) == [1, 2] and "never arrived" in reasons[1] and "within 0.2 s" in reasons[2]
    assert [s.output_token_ids for s in seqs] == colocated_tokens and dec.worker.told == {}
    assert _full(pre) and _full(dec) and store.keys() == []
