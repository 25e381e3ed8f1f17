"""Payloads as bytes on the wire: packing, unpacking, and sending a payload as it lies."""
import torch

from mergecomp.kernels.wire import pack_payload, unpack_payload


def test_a_payload_of_several_tensors_is_packed_on_8_byte_boundaries_and_viewed_back():
    payload = (torch.arange(5, dtype=torch.uint8), torch.tensor([1.5, -2.0]), torch.tensor([7], dtype=torch.int64))
    raw, specs = pack_payload(payload, borrow=True)  # several tensors: always a copy
    assert raw.numel() == 8 + 8 + 8 and raw[5:8].eq(0).all()
    back = unpack_payload(raw, specs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, payload))


def test_a_borrowed_tensor_goes_as_it_lies_with_the_bytes_a_copy_would_send():
    words = torch.zeros(16, dtype=torch.uint8)
    bits = words[:13]
    bits.copy_(torch.arange(1, 14, dtype=torch.uint8))
    copied, specs = pack_payload((bits,))
    borrowed, borrowed_specs = pack_payload((bits,), borrow=True)
    assert borrowed.data_ptr() == bits.data_ptr() and borrowed.numel() == 16  # no copy, padded to a word
    assert torch.equal(borrowed, copied) and borrowed_specs == specs
    assert torch.equal(unpack_payload(borrowed, specs)[0], bits)
    bits[0] = 99  # what goes on the wire is the tensor itself
    assert borrowed[0] == 99


def test_a_tensor_without_room_for_its_padding_or_off_a_word_boundary_is_copied():
    exact = torch.arange(1, 14, dtype=torch.uint8)  # its storage ends with it
    raw, _ = pack_payload((exact,), borrow=True)
    assert raw.data_ptr() != exact.data_ptr() and raw.numel() == 16 and raw[13:].eq(0).all()
    shifted = torch.zeros(32, dtype=torch.uint8)[3:16]  # starts 3 bytes into its storage
    raw, _ = pack_payload((shifted,), borrow=True)
    assert raw.data_ptr() != shifted.data_ptr()
    words = torch.arange(4, dtype=torch.float64)  # whole words: borrowed as they are
    raw, specs = pack_payload((words,), borrow=True)
    assert raw.data_ptr() == words.data_ptr() and torch.equal(unpack_payload(raw, specs)[0], words)
